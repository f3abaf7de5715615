"""CUDA check of the expert hierarchy: exactness with the cache on the GPU, and B_P / B_H there.

    python bench/gpu_check.py [--json OUT] [--shape-layers 4]

1. Exactness: tiny random checkpoints run with the expert cache on the GPU (0 slots, 1 slot, 10 %,
   37 %, 100 % of the experts; q from the table, forced to 0 and to m) must give the plain engine's
   logits (fp32, ≤ 1e-5 relative) and greedy tokens (bf16, 32 steps), at batch 1 and 4.
   Prefill streamed through whole-layer buffers (two, one, and the fallback) likewise.
2. The cache-control step compiled with ``torch.compile(fullgraph=True)`` on the GPU equals eager.
3. Bandwidths on real expert shapes (Qwen3-30B-A3B: hidden 2048, expert intermediate 768, bf16):
   B_P from batched pinned fills, B_H from the CPU expert kernel, and the resulting q table.
4. The GPU executor (``bench/gpu_executor.py``): dense part, KV cache and sampling on the GPU, at
   cache fractions 0, 0.1, 0.37 and 1, in eager and fixed-shape steps (eager, compiled), for a plain
   and a hybrid family, against the CPU engine; host syncs inside a compiled step; decode tok/s next
   to the model bound, also under 8 and 24 GB VRAM budgets; prefill at 4k and 16k tokens next to
   the PCIe bound; elastic resizes on the GPU.
Without CUDA it says so and exits 0. ``--quick`` runs sections 1-3 only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import emit  # noqa: E402

PROMPTS = [[5, 17, 33, 99, 100, 3, 7, 200, 201, 45], [300, 12, 12, 250, 8], list(range(40, 110)),
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301]]
CAPACITIES = ["0slots", "1slot", "0.1", "0.37", "1.0"]


def _logits_run(llm, prompts, steps):
    from hearth.engine import SamplingParams
    from tests.checkpoints import record_logits

    recorded = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs], [torch.stack(recorded[o.request_id]) for o in outs]


def check_exactness(root: Path) -> list[dict]:
    from hearth.engine import LLM
    from tests.checkpoints import make_checkpoint

    results = []
    for dtype in ("float32", "bfloat16"):
        path = root / dtype
        make_checkpoint(path, "qwen3_moe", "per_expert", dtype, num_experts=16, num_experts_per_tok=4)
        for batch in (1, 4):
            prompts = PROMPTS[:batch]
            ref_tokens, ref_logits = _logits_run(LLM(path, device="cpu", expert_device="none"), prompts, 32)
            for capacity in CAPACITIES:
                for q_mode in ("table", "zero", "all"):
                    llm = LLM(path, expert_device="cuda", expert_cache=capacity, q_mode=q_mode)
                    tokens, logits = _logits_run(llm, prompts, 32)
                    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits,
                                                                                          strict=True))
                    ok = tokens == ref_tokens and (dtype == "bfloat16" or err <= 1e-5)
                    stats = llm.engine.stats()["experts"]
                    results.append({"dtype": dtype, "batch": batch, "capacity": capacity, "q_mode": q_mode,
                                    "tokens_equal": tokens == ref_tokens, "max_rel_error": err, "ok": ok,
                                    "fills": stats["fills"], "cpu": stats["cpu"], "hits": stats["hits"]})
                    llm.engine.close()
    return results


def check_streaming(root: Path) -> list[dict]:
    """Prefill streamed through whole-layer buffers on the GPU (two buffers, one, and the
    decode-path fallback) against the plain engine, for prompts around and beyond a chunk."""
    from hearth.engine import LLM

    results = []
    for dtype in ("float32", "bfloat16"):
        path = root / dtype  # built by check_exactness
        prompts = [[(i * 37) % 380 + 3 for i in range(n)] for n in (65, 1000)]
        ref_tokens, ref_logits = _logits_run(LLM(path, device="cpu", expert_device="none", prefill_chunk=64),
                                             prompts, 8)
        for mode, cache in (("double", "40slots"), ("single", "40slots"), ("fallback", "20slots")):
            llm = LLM(path, expert_device="cuda", expert_cache=cache, prefill_chunk=64, stream_min_tokens=32,
                      double_buffer=mode != "single")
            tokens, logits = _logits_run(llm, prompts, 8)
            err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits, strict=True))
            stats = llm.engine.stats()["experts"]
            results.append({"dtype": dtype, "mode": mode, "tokens_equal": tokens == ref_tokens, "max_rel_error": err,
                            "ok": tokens == ref_tokens and (dtype == "bfloat16" or err <= 1e-5),
                            "streamed_steps": stats.get("prefill_streamed_steps", 0),
                            "hidden_share": stats.get("prefill_hidden_share")})
            llm.engine.close()
    return results


def check_compile() -> bool:
    from hearth.engine.experts.policy.cache import ExpertCacheTables, cache_step

    compiled = torch.compile(cache_step, fullgraph=True, dynamic=False)
    a = ExpertCacheTables(256, 24, torch.arange(65), 64, device="cuda")
    b = ExpertCacheTables(256, 24, torch.arange(65), 64, device="cuda")
    g = torch.Generator().manual_seed(0)
    for step in range(64):
        ids = (torch.randint(0, 64, (32,), generator=g) + 64 * (step % 4)).cuda()
        pa, pb = a.step(ids), b.step(ids, step_fn=compiled)
        if not (torch.equal(pa.pair_slot, pb.pair_slot) and torch.equal(pa.src, pb.src)):
            return False
    return torch.equal(a.slot_of, b.slot_of) and torch.equal(a.last_used, b.last_used)


def measure_real_shapes(root: Path, layers: int) -> dict:
    from hearth.engine.experts.measure import measure_host_path, measure_link_path
    from hearth.engine.experts.mechanism.device import CudaDevice
    from hearth.engine.experts.policy.qstar import SplitCosts, build_qtable
    from hearth.engine.ftw import load_checkpoint
    from hearth.engine.ops import activation
    from tests.checkpoints import make_checkpoint

    path = root / "qwen3-30b-shapes"
    make_checkpoint(path, "qwen3_moe", "fused", "bfloat16", hidden_size=2048, num_hidden_layers=layers,
                    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=64,
                    num_experts_per_tok=8, moe_intermediate_size=768, intermediate_size=6144, vocab_size=4096,
                    shard_bytes=2 << 30)
    loaded = load_checkpoint(path)
    pool, cfg = loaded.pool, loaded.config
    host = measure_host_path(pool, activation(cfg.hidden_act), cfg.top_k, repeats=15)
    device = CudaDevice(pool, 64)
    link = measure_link_path(device, pool, 32, repeats=15)
    costs = SplitCosts(pool.expert_bytes, link, host.bytes_per_s, cpu_fixed_s=host.fixed_s)
    qtable = build_qtable(costs, 16).tolist()
    device.close()
    return {"expert_bytes": pool.expert_bytes, "B_P_GBps": link.bytes_per_s / 1e9, "fill_fixed_us": link.fixed_s * 1e6,
            "B_H_GBps": host.bytes_per_s / 1e9, "cpu_fixed_us": host.fixed_s * 1e6, "qtable_m0_16": qtable}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shape-layers", type=int, default=2, help="MoE layers of the real-shape model")
    ap.add_argument("--quick", action="store_true", help="the hierarchy checks only (sections 1-3)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to check (the CPU suite covers the rest)")
        return 0
    start = time.time()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report["exactness"] = check_exactness(root)
        report["exactness"] += check_streaming(root)
        report["compile_ok"] = check_compile()
        report["bandwidth"] = measure_real_shapes(root, args.shape_layers)
        if not args.quick:
            report["executor"] = run_executor_checks(root)
    report["all_exact"] = all(r["ok"] for r in report["exactness"])
    report["seconds"] = time.time() - start
    bad = [r for r in report["exactness"] if not r["ok"]]
    print(f"device: {report['device']}")
    print(f"exactness: {len(report['exactness']) - len(bad)}/{len(report['exactness'])} configurations equal the "
          "plain engine" + (f"; failing: {bad}" if bad else ""))
    print(f"cache step compiled (fullgraph) equals eager on CUDA: {report['compile_ok']}")
    bw = report["bandwidth"]
    print(f"real shapes: expert {bw['expert_bytes'] / 2**20:.2f} MiB, B_P {bw['B_P_GBps']:.1f} GB/s, "
          f"B_H {bw['B_H_GBps']:.1f} GB/s, qtable[0..16] {bw['qtable_m0_16']}")
    executor_ok = True
    for row in report.get("executor", []):
        executor_ok &= bool(row.get("ok"))
        detail = {k: v for k, v in row.items() if k not in ("check", "seconds", "where")}
        print(f"{'ok  ' if row.get('ok') else 'FAIL'} {row['check']} ({row['seconds']} s): {detail}")
        if "where" in row:
            print("     " + "\n     ".join(row["where"]))
    emit(report, args.json)
    return 0 if report["all_exact"] and report["compile_ok"] and executor_ok else 1


def run_executor_checks(root: Path) -> list[dict]:
    from bench import gpu_executor as ex

    rows = ex.check_exactness(root)
    rows.append(ex.guarded("no host sync inside a compiled step", ex.check_sync_free, root))
    rows += ex.check_speed(root)
    for budget in (8, 24):
        rows += ex.check_speed(root, budget)
    rows += ex.check_prefill(root)
    rows.append(ex.guarded("elastic resize on the GPU", ex.check_elastic, root))
    return rows


if __name__ == "__main__":
    sys.exit(main())
