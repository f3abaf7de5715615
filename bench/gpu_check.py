"""The GPU check: the expert hierarchy and the GPU executor on a CUDA device, and the targets.

    python bench/gpu_check.py [--json OUT] [--budget-s 540] [--shape-layers 4] [--cpu-dry-run]

Sections, most important first (a section that would start past ``--budget-s`` is reported as
skipped, so one call fits a device lease):

1. The executor against the CPU engine (``bench/gpu_executor.py``): dense part, KV cache and
   sampling on the GPU, experts through the hierarchy at cache fractions 0, 0.1, 0.37 and 1, plain
   steps and steps captured as CUDA graphs, a plain family (fp32 and bf16) and a hybrid one.
2. No host synchronisation inside a captured step (``torch.cuda.set_sync_debug_mode("error")``).
3. Decode tok/s of the ~1B random Qwen3-MoE at batch 1 at each fraction, plain and captured,
   next to the model bound.
4. Prefill at 4k and 16k tokens next to the PCIe bound.
5. Elastic resizes on the GPU: tokens as without, memory given back.
6. B_P and B_H on real expert shapes (Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate
   768, bf16), the q table from them, and 8 GB and 24 GB consumer GPUs emulated on that model.
7. The hierarchy alone (the dense part on the CPU): exactness at 0, 1 slot, 10 %, 37 %, 100 % of
   the experts with q from the table, forced to 0 and to m; prefill streamed through two buffers,
   one, and the fallback; the cache-control step compiled whole equals eager.
8. The later families (OLMoE, GLM-4.5, DeepSeek-V3/V2, MiniMax-M2, GPT-OSS, DeepSeek-V4) on the device, plain
   steps, against the CPU engine.

Then the acceptance targets, each met or not. Without CUDA it says so and exits 0;
``--cpu-dry-run`` runs every section on the CPU instead (the virtual device, small models, the
fixed-shape step eager): a test of the script itself, whose numbers say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import gpu_executor as ex  # noqa: E402
from bench.common import emit  # noqa: E402

CAPACITIES = ["0slots", "1slot", "0.1", "0.37", "1.0"]


def check_hierarchy(rig: ex.Rig, root: Path) -> list[dict]:
    """The expert cache on the device, the dense part on the CPU, against the plain CPU engine
    (fp32 logits within 1e-5, bf16 tokens equal) at batch 1 and 4."""
    from hearth.engine import LLM
    from tests.checkpoints import make_checkpoint

    rows = []
    for dtype in ("float32", "bfloat16"):
        path = root / f"hier-{dtype}"
        make_checkpoint(path, "qwen3_moe", "per_expert", dtype, num_experts=16, num_experts_per_tok=4)
        for batch in (1, 4):
            prompts = ex.PROMPTS[:batch]
            ref = ex.run(LLM(path, device="cpu", expert_device="none"), prompts, 32)
            cases = [(c, "table") for c in CAPACITIES] + [("0.37", "zero"), ("0.37", "all")]
            for capacity, q_mode in cases:
                def one(path=path, prompts=prompts, ref=ref, capacity=capacity, q_mode=q_mode, dtype=dtype):
                    llm = LLM(path, device="cpu", expert_device=rig.expert_device, expert_cache=capacity,
                              q_mode=q_mode)
                    tokens, logits = ex.run(llm, prompts, 32)
                    stats = llm.engine.stats()["experts"]
                    llm.close()
                    return ex.compare(tokens, logits, ref, dtype == "float32", 1e-5) | {
                        "fills": stats["fills"], "cpu": stats["cpu"], "hits": stats["hits"]}
                rows.append(ex.guarded(f"hierarchy {dtype} batch={batch} cache={capacity} q={q_mode}", one))
    return rows


def check_streaming(rig: ex.Rig, root: Path) -> list[dict]:
    """Prefill streamed through whole-layer buffers on the device (two buffers, one, and the
    decode-path fallback) against the plain engine, for prompts around and beyond a chunk."""
    from hearth.engine import LLM

    rows = []
    for dtype in ("float32", "bfloat16"):
        path = root / f"hier-{dtype}"  # built by check_hierarchy
        prompts = [[(i * 37) % 380 + 3 for i in range(n)] for n in (65, 1000)]
        ref = ex.run(LLM(path, device="cpu", expert_device="none", prefill_chunk=64), prompts, 8)
        for mode, cache in (("double", "40slots"), ("single", "40slots"), ("fallback", "20slots")):
            def one(path=path, prompts=prompts, ref=ref, mode=mode, cache=cache, dtype=dtype):
                llm = LLM(path, device="cpu", expert_device=rig.expert_device, expert_cache=cache, prefill_chunk=64,
                          stream_min_tokens=32, double_buffer=mode != "single")
                tokens, logits = ex.run(llm, prompts, 8)
                stats = llm.engine.stats()["experts"]
                llm.close()
                return ex.compare(tokens, logits, ref, dtype == "float32", 1e-5) | {
                    "streamed_steps": stats.get("prefill_streamed_steps", 0),
                    "hidden_share": stats.get("prefill_hidden_share")}
            rows.append(ex.guarded(f"streamed prefill {dtype} {mode}", one))
    return rows


def check_compile(rig: ex.Rig) -> dict:
    """The cache-control step compiled with ``fullgraph=True`` on the device equals eager."""
    from hearth.engine.experts.policy.cache import ExpertCacheTables, cache_step

    compiled = torch.compile(cache_step, fullgraph=True, dynamic=False)
    a = ExpertCacheTables(256, 24, torch.arange(65), 64, device=rig.device)
    b = ExpertCacheTables(256, 24, torch.arange(65), 64, device=rig.device)
    g = torch.Generator().manual_seed(0)
    for step in range(64):
        ids = (torch.randint(0, 64, (32,), generator=g) + 64 * (step % 4)).to(rig.device)
        pa, pb = a.step(ids), b.step(ids, step_fn=compiled)
        if not (torch.equal(pa.pair_slot, pb.pair_slot) and torch.equal(pa.src, pb.src)):
            return {"ok": False, "first_difference_at_step": step}
    return {"ok": torch.equal(a.slot_of, b.slot_of) and torch.equal(a.last_used, b.last_used)}


def real_shapes(rig: ex.Rig, root: Path, layers: int) -> Path:
    """Qwen3-30B-A3B's expert and attention shapes, ``layers`` layers (bf16); small on the dry run."""
    from tests.checkpoints import make_checkpoint

    path = root / "qwen3-30b-shapes"
    if not path.exists():
        make_checkpoint(path, "qwen3_moe", "fused", "bfloat16", hidden_size=512 if rig.dry else 2048,
                        num_hidden_layers=layers, num_attention_heads=8 if rig.dry else 32,
                        num_key_value_heads=2 if rig.dry else 4, head_dim=64 if rig.dry else 128,
                        num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=192 if rig.dry else 768, intermediate_size=6144, vocab_size=4096,
                        shard_bytes=2 << 30)
    return path


def measure_bandwidths(rig: ex.Rig, path: Path) -> dict:
    """B_P from batched fills into the device's slots, B_H from the CPU expert kernel, and the q
    table they give."""
    from hearth.engine.checkpoint.dispatch import load_checkpoint
    from hearth.engine.experts.build import build_device
    from hearth.engine.experts.measure import measure_host_path, measure_link_path
    from hearth.engine.experts.policy.qstar import SplitCosts, build_qtable
    from hearth.engine.ops import activation

    loaded = load_checkpoint(path)
    pool, cfg = loaded.pool, loaded.config
    host = measure_host_path(pool, activation(cfg.hidden_act), cfg.top_k, repeats=15)
    device = build_device(rig.expert_device, pool, 64)
    link = measure_link_path(device, pool, 32, repeats=15)
    costs = SplitCosts(pool.expert_bytes, link, host.bytes_per_s, cpu_fixed_s=host.fixed_s)
    qtable = build_qtable(costs, 16).tolist()
    if hasattr(device, "close"):
        device.close()
    return {"ok": True, "expert_bytes": pool.expert_bytes, "B_P_GBps": link.bytes_per_s / 1e9,
            "fill_fixed_us": link.fixed_s * 1e6, "B_H_GBps": host.bytes_per_s / 1e9,
            "cpu_fixed_us": host.fixed_s * 1e6, "qtable_m0_16": qtable}


def sections(rig: ex.Rig, root: Path, layers: int) -> list[tuple[str, object]]:
    """(name, thunk returning rows) in the order they run."""
    def shapes_and_emulation() -> list[dict]:
        path = real_shapes(rig, root, layers)
        return [ex.guarded("B_P and B_H on real expert shapes", measure_bandwidths, rig, path),
                *ex.check_emulation(rig, path, layers)]

    return [
        ("executor exactness", lambda: ex.check_exactness(rig, root)),
        ("host syncs", lambda: [ex.guarded("no host sync inside a captured step", ex.check_sync_free, rig, root)]),
        ("decode speed", lambda: ex.check_speed(rig, root)),
        ("prefill speed", lambda: ex.check_prefill(rig, root)),
        ("elastic resize", lambda: [ex.guarded("elastic resize on the device", ex.check_elastic, rig, root)]),
        ("bandwidths and emulation", shapes_and_emulation),
        ("hierarchy exactness", lambda: check_hierarchy(rig, root) + check_streaming(rig, root)),
        ("compiled cache step", lambda: [ex.guarded("cache step compiled whole equals eager", check_compile, rig)]),
        ("families", lambda: ex.check_families(rig, root)),
    ]


def _row(rows: list[dict], check: str) -> dict:
    return next((r for r in rows if r["check"] == check), {})


def targets(rig: ex.Rig, rows: list[dict]) -> list[dict]:
    """The acceptance targets from the rows: each with its value and whether it is met (None when
    its rows are missing or failed)."""
    def ratio(a: dict, b: dict, key: str = "tok_s") -> float | None:
        return a[key] / b[key] if key in a and key in b and b[key] else None

    kinds = ("exact ", "hierarchy ", "streamed prefill", "elastic", "family ")
    exact = [r for r in rows if r["check"].startswith(kinds) and r.get("ok") is not None]  # None: reported only
    fast = rig.fast_mode
    graph_ratio = ratio(_row(rows, f"speed cache=1.0 static={fast}"), _row(rows, "speed cache=1.0 static=off"))
    best = {f: max((_row(rows, f"speed cache={f} static={m}").get("share", 0) for m in ("off", fast)), default=0)
            for f in ("1.0", "0.37")}
    prefill = _row(rows, f"prefill {512 if rig.dry else 16384}").get("share")
    sync = _row(rows, "no host sync inside a captured step")
    out = [("every exactness check", all(r.get("ok") for r in exact) if exact else None, len(exact), "all"),
           ("no host sync inside a replay", sync.get("ok"), sync.get("sync_inside_step"), "none"),
           ("captured / plain decode at batch 1, cache 1.0", None if graph_ratio is None else graph_ratio >= 1.5,
            graph_ratio, ">= 1.5"),
           ("decode / model bound at cache 1.0", best["1.0"] >= 0.9 if best["1.0"] else None, best["1.0"], ">= 0.9"),
           ("decode / model bound at cache 0.37", best["0.37"] >= 0.8 if best["0.37"] else None, best["0.37"],
            ">= 0.8"),
           ("prefill 16k / PCIe bound", None if prefill is None else prefill >= 0.9, prefill, ">= 0.9")]
    return [{"target": name, "met": met, "value": value, "goal": goal} for name, met, value, goal in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shape-layers", type=int, default=4, help="layers of the real-shape model (of 48)")
    ap.add_argument("--budget-s", type=float, default=540, help="start no section past this many seconds")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="every section on the CPU (virtual device, small models): tests the script, not a GPU")
    ap.add_argument("--only", nargs="*", default=None, metavar="SECTION", help="run only sections whose names "
                    "start with these words")
    args = ap.parse_args()
    rig = ex.Rig(dry=args.cpu_dry_run)
    if not rig.dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to check (the CPU suite covers the rest; "
              "--cpu-dry-run runs this script's sections on the CPU)")
        return 0
    start = time.time()
    report: dict = {"device": "cpu (dry run)" if rig.dry else torch.cuda.get_device_name(),
                    "torch": torch.__version__, "rows": [], "skipped_sections": []}
    print(f"device: {report['device']}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, thunk in sections(rig, Path(tmp), args.shape_layers):
            if args.only is not None and not any(name.startswith(w) for w in args.only):
                continue
            if time.time() - start > args.budget_s:
                report["skipped_sections"].append(name)
                print(f"SKIP {name}: past the time budget", flush=True)
                continue
            for row in thunk():
                report["rows"].append(row)
                _print_row(row)
    report["targets"] = targets(rig, report["rows"])
    report["seconds"] = round(time.time() - start, 1)
    print("targets:")
    for t in report["targets"]:
        mark = {True: "met ", False: "MISS", None: "n/a "}[t["met"]]
        value = f"{t['value']:.3g}" if isinstance(t["value"], float) else t["value"]
        print(f"  {mark} {t['target']}: {value} (goal {t['goal']})")
    emit(report, args.json)
    failed = [r["check"] for r in report["rows"] if r.get("ok") is False]
    print(f"{len(report['rows'])} checks in {report['seconds']} s; failed: {failed or 'none'}")
    return 1 if failed else 0


def _print_row(row: dict) -> None:
    mark = {True: "ok  ", False: "FAIL", None: "skip"}[row.get("ok")]
    detail = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
              if k not in ("check", "seconds", "where", "ok")}
    print(f"{mark} {row['check']} ({row['seconds']} s): {detail}", flush=True)
    if "where" in row:
        print("     " + "\n     ".join(row["where"]), flush=True)


if __name__ == "__main__":
    sys.exit(main())
