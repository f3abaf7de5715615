"""``hearth profile``: measure B_P and B_H on this machine and print the q* table they give (imported
by the command when it runs, so its engine imports load nothing for other commands)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hearth.config import EngineConfig
from hearth.engine.cache.kv_pages import kv_cache_tokens
from hearth.engine.checkpoint.dispatch import load_checkpoint
from hearth.engine.executor.memory_plan import plan_vram, tensor_bytes
from hearth.engine.experts.build import build_device
from hearth.engine.experts.measure import measure_host_path, measure_link_path, measure_stream_read
from hearth.engine.experts.policy.qstar import SplitCosts, build_qtable, step_seconds
from hearth.engine.ops import activation


def run_profile(args: argparse.Namespace) -> int:
    loaded = load_checkpoint(args.model, None if args.dtype == "auto" else args.dtype, show_progress=not args.json)
    cfg, pool = loaded.config, loaded.pool
    memory = memory_report(loaded, cfg, args.vram_limit)  # before any arena of ours takes GPU memory
    host = measure_host_path(pool, activation(cfg.hidden_act), cfg.top_k, args.repeats)
    kind = "virtual" if args.virtual_device else "cuda" if torch.cuda.is_available() else None
    device = build_device(kind, pool, cfg.top_k, args.virtual_link_gbps) if kind else None
    link_cost = measure_link_path(device, pool, cfg.top_k, args.repeats) if device is not None else None
    costs = SplitCosts(pool.expert_bytes, link_cost, host.bytes_per_s, cpu_fixed_s=host.fixed_s)
    m_max = min(cfg.num_experts, 4 * cfg.top_k)
    qtable = build_qtable(costs, m_max).tolist()
    # Every column under the same cost model: with a device the CPU share is planned at B_R.
    rows = [{"m": m, "q": q, "expected_ms": step_seconds(costs, m, q) * 1e3,
             "fill_all_ms": step_seconds(costs, m, m) * 1e3 if device is not None else None,
             "all_cpu_ms": step_seconds(costs, m, 0) * 1e3} for m, q in enumerate(qtable)]
    report = {
        "expert_bytes": pool.expert_bytes,
        "device": device.kind if device is not None else None,
        "B_H_GBps": host.bytes_per_s / 1e9, "cpu_fixed_us": host.fixed_s * 1e6,
        "stream_read_GBps": measure_stream_read() / 1e9,
        "B_P_GBps": link_cost.bytes_per_s / 1e9 if link_cost else None,
        "fill_fixed_us": link_cost.fixed_s * 1e6 if link_cost else None,
        "B_R_GBps": costs.cpu.bytes_per_s / 1e9 if costs.cpu else None,
        "qtable": qtable, "rows": rows,
    }
    if device is not None:
        device.close()
    report["memory"] = memory
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    _print_report(report)
    return 0


def memory_report(loaded, cfg, vram_limit: int | None = None) -> dict:
    """What the GPU executor would hold on this machine's GPU (dense weights, a full context's KV
    cache, expert slots in the rest; within ``vram_limit`` bytes when given), or the sizes alone
    without a GPU."""
    model = loaded.model
    # Every device's: the dense part is loaded on the host here and would move to the GPU.
    weights = tensor_bytes([*model.parameters(), *model.buffers()], None)
    per_token = cfg.kv_bytes_per_token
    config = EngineConfig()
    tokens = kv_cache_tokens(config, cfg, config.context_length(cfg.max_position_embeddings))  # as the engine sizes it
    out = {"dense_weight_bytes": weights, "kv_bytes_per_token": per_token, "context_tokens": tokens,
           "expert_bytes": loaded.pool.expert_bytes, "vram": None}
    if torch.cuda.is_available():
        free = torch.cuda.mem_get_info()[0]
        if vram_limit is not None:
            free = min(free, vram_limit)
        plan = plan_vram(free, weights, per_token, tokens, loaded.pool.expert_bytes,
                         loaded.pool.gate_up.shape[0])
        out["vram"] = {"device": torch.cuda.get_device_name(), **plan.__dict__, "fits": plan.fits()}
    return out


def _print_memory(m: dict) -> None:
    kib = m["kv_bytes_per_token"] / 1024
    context_gib = m["kv_bytes_per_token"] * m["context_tokens"] / 2**30
    print(f"dense weights      {m['dense_weight_bytes'] / 2**30:.2f} GiB; KV cache {kib:.1f} KiB per token "
          f"({context_gib:.2f} GiB for {m['context_tokens']} tokens)")
    v = m["vram"]
    if v is None:
        print("VRAM               no CUDA device: the GPU executor's plan needs one")
    elif not v["fits"]:
        print(f"VRAM ({v['device']})  {v['free'] / 2**30:.1f} GiB free: the dense weights and a full context's KV "
              "cache do not fit (--max-model-len, or --device cpu)")
    else:
        print(f"VRAM ({v['device']})  {v['free'] / 2**30:.1f} GiB free: weights {v['weights'] / 2**30:.2f} GiB, "
              f"KV {v['kv_cache'] / 2**30:.2f} GiB, expert cache {v['cache_slots']} slots "
              f"({v['cache_bytes'] / 2**30:.2f} GiB)")


def _print_report(r: dict) -> None:
    _print_memory(r["memory"])
    print(f"expert size        {r['expert_bytes'] / 2**20:.2f} MiB")
    print(f"B_H (CPU experts)  {r['B_H_GBps']:.1f} GB/s  (+{r['cpu_fixed_us']:.0f} us per dispatch); "
          f"{r['B_H_GBps'] / r['stream_read_GBps']:.0%} of a plain memory read ({r['stream_read_GBps']:.1f} GB/s)")
    if r["device"] is None:
        print("B_P                no device path (no CUDA GPU; use --virtual-device to profile the virtual "
              "device): every miss runs on the CPU", file=sys.stdout)
    else:
        print(f"B_P ({r['device']:>7})    {r['B_P_GBps']:.1f} GB/s  (+{r['fill_fixed_us']:.0f} us per fill batch)")
        print(f"B_R = B_H - B_P    {r['B_R_GBps']:.1f} GB/s")
    print()
    print(f"{'m':>3} {'q*':>3} {'expected ms':>12} {'fill-all ms':>12} {'all-CPU ms':>11}")
    for row in r["rows"]:
        fill_all = f"{row['fill_all_ms']:.3f}" if row["fill_all_ms"] is not None else "-"
        print(f"{row['m']:>3} {row['q']:>3} {row['expected_ms']:>12.3f} {fill_all:>12} {row['all_cpu_ms']:>11.3f}")
