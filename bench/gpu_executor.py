"""GPU executor checks for ``bench/gpu_check.py``: the dense part, the KV cache and sampling on the
GPU, the experts through the hierarchy; eager steps, fixed-shape steps (eager and compiled), elastic
VRAM, speed next to the bounds, and a small consumer GPU emulated by a VRAM budget. Each check
reports what it found and goes on, so that one run shows every failure."""

from __future__ import annotations

import time
import traceback
from pathlib import Path

import torch

FRACTIONS = ("0slots", "0.1", "0.37", "1.0")
PROMPTS = [[5, 17, 33, 99, 100, 3, 7, 200, 201, 45], [300, 12, 12, 250, 8], list(range(40, 110)),
           [9, 8, 7, 6, 5, 4, 3, 2, 1, 300, 301]]


def guarded(name: str, fn, *args) -> dict:
    """fn(*args) as a report row; an exception becomes the row's error (with its last frames)."""
    start = time.time()
    try:
        out = fn(*args)
        row = out if isinstance(out, dict) else {"result": out}
    except Exception as exc:  # noqa: BLE001 - a failed check is reported, the run goes on
        row = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
               "where": traceback.format_exc().splitlines()[-6:]}
    row["check"], row["seconds"] = name, round(time.time() - start, 1)
    return row


def mode_options(mode: str) -> dict:
    """Engine options for a static-decode mode: graph mode needs the CPU experts behind the task
    ring (a worker process on a shared pool), which the GPU feeds itself."""
    if mode != "graph":
        return {"static_decode": mode}
    import uuid

    return {"static_decode": mode, "cpu_experts": "process", "host_pool_name": f"gpucheck-{uuid.uuid4().hex[:8]}"}


def _run(llm, prompts, steps):
    from hearth.engine import SamplingParams
    from tests.checkpoints import record_logits

    recorded = record_logits(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    return [o.token_ids for o in outs], [torch.stack(recorded[o.request_id]).float().cpu() for o in outs]


def _compare(tokens, logits, ref, fp32: bool) -> dict:
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref[1], strict=True))
    equal = tokens == ref[0]
    return {"tokens_equal": equal, "max_rel_error": err, "ok": equal and (not fp32 or err <= 1e-4)}


def check_exactness(root: Path) -> list[dict]:
    """Dense on the GPU, experts through the hierarchy at each cache fraction, eager and fixed-shape
    steps (eager, compiled), against the CPU engine: fp32 logits within 1e-4, bf16 tokens equal; a
    plain family (Qwen3-MoE, fp32 and bf16) and a hybrid one (Qwen3-Next)."""
    from hearth.engine import LLM
    from tests.checkpoints import make_checkpoint

    rows = []
    for family, dtype in (("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("qwen3_next", "float32")):
        path = root / f"exec-{family}-{dtype}"
        make_checkpoint(path, family, "per_expert", dtype, num_experts=16, num_experts_per_tok=4)
        ref = _run(LLM(path, device="cpu", expert_device="none"), PROMPTS, 32)
        for fraction in FRACTIONS:
            for mode in ("off", "eager", "compile", "graph"):
                def one(path=path, fraction=fraction, mode=mode, dtype=dtype, ref=ref):
                    llm = LLM(path, device="cuda", expert_device="cuda", expert_cache=fraction, **mode_options(mode))
                    tokens, logits = _run(llm, PROMPTS, 32)
                    row = _compare(tokens, logits, ref, dtype == "float32")
                    row["static_steps"] = llm.engine.runner.static.steps if llm.engine.runner.static else 0
                    llm.close()
                    return row
                rows.append(guarded(f"exact {family} {dtype} cache={fraction} static={mode}", one)
                            | {"family": family, "dtype": dtype, "fraction": fraction, "static": mode})
    return rows


def check_sync_free(root: Path) -> dict:
    """Host synchronisations inside a compiled fixed-shape step, caught by torch's sync debug mode
    (error). The step's fill reads its count on the host today: this check says so until a
    device-side count-aware gather replaces it."""
    from hearth.engine import LLM

    llm = LLM(root / "exec-qwen3_moe-float32", device="cuda", expert_device="cuda", expert_cache="0.37",
              **mode_options("graph"))
    _run(llm, PROMPTS, 4)  # compiled and warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(llm, PROMPTS[:1], 4)
        found = None
    except RuntimeError as exc:
        found = str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        llm.close()
    return {"ok": found is None, "sync_inside_step": found}


def gpu_read_rate() -> float:
    """Device memory bandwidth in bytes/s (a large device-to-device copy reads and writes it)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 10 * a.numel() / (time.perf_counter() - start)


def check_speed(root: Path, budget_gb: float | None = None) -> list[dict]:
    """Decode tok/s (batch 1, 64 tokens) of the ~1B random Qwen3-MoE at cache fractions, eager and
    compiled fixed-shape steps, next to the model bound: the largest of (dense + cached expert bytes)
    / GPU bandwidth, filled bytes / B_P and CPU-expert bytes / B_R per token. With ``budget_gb`` the
    cache gets what a GPU of that size would leave (the consumer GPU emulation)."""
    from hearth.engine import LLM, SamplingParams
    from tests.checkpoints import make_checkpoint

    path = root / "exec-1b"
    if not path.exists():
        make_checkpoint(path, "qwen3_moe", "fused", "bfloat16", hidden_size=1024, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_experts=64,
                        num_experts_per_tok=8, moe_intermediate_size=256, intermediate_size=2048, vocab_size=32000,
                        shard_bytes=1 << 30)
    bandwidth = gpu_read_rate()
    rows = []
    fractions = FRACTIONS if budget_gb is None else (None,)
    for fraction in fractions:
        for mode in ("off", "compile", "graph"):
            def one(fraction=fraction, mode=mode):
                cache = fraction if budget_gb is None else f"{int(budget_gb * 2**30 * 0.7)}b"
                llm = LLM(path, device="cuda", expert_device="cuda", expert_cache=cache, **mode_options(mode))
                params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
                llm.generate([PROMPTS[2]], params)  # warm (and compiled)
                before = llm.engine.stats()["experts"]
                start = time.perf_counter()
                llm.generate([PROMPTS[2]], params)
                seconds = time.perf_counter() - start
                after = llm.engine.stats()["experts"]
                model = llm.engine.runner.model
                dense = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
                tokens = 64
                filled = (after["fill_bytes"] - before["fill_bytes"]) / tokens
                cpu = (after["cpu_bytes"] - before["cpu_bytes"]) / tokens
                hits = (after["hits"] - before["hits"]) * after["expert_bytes"] / tokens
                b_p, b_h = after.get("b_p") or 1, after.get("b_h") or 1
                bound = max((dense + hits) / bandwidth, filled / b_p, cpu / max(b_h - b_p, 1))
                llm.close()
                return {"tok_s": tokens / seconds, "bound_tok_s": 1 / bound, "share": (tokens / seconds) * bound,
                        "slots": after["slots"], "ok": True}
            rows.append(guarded(f"speed cache={fraction or budget_gb} static={mode}", one)
                        | {"fraction": fraction, "budget_gb": budget_gb, "static": mode})
    return rows


def check_prefill(root: Path) -> list[dict]:
    """Prefill tok/s at 4k and 16k tokens (chunked, whole layers streamed on the copy stream) next
    to the PCIe bound (every expert crosses the link once per chunk at B_P)."""
    from hearth.engine import LLM, SamplingParams

    path = root / "exec-1b"
    rows = []
    for n in (4096, 16384):
        def one(n=n):
            llm = LLM(path, device="cuda", expert_device="cuda", expert_cache="0.37", max_model_len=n + 64,
                      prefill_chunk=4096)
            prompt = [(i * 31) % 30000 + 3 for i in range(n)]
            params = SamplingParams(max_tokens=1, temperature=0)
            llm.generate([prompt[:512]], params)
            start = time.perf_counter()
            llm.generate([prompt], params)
            seconds = time.perf_counter() - start
            stats = llm.engine.stats()["experts"]
            chunks = -(-n // 4096)
            bound = chunks * llm.engine.pool.nbytes / (stats.get("b_p") or 1)
            llm.close()
            return {"tok_s": n / seconds, "pcie_bound_tok_s": n / bound, "share": bound / seconds,
                    "hidden_share": stats.get("prefill_hidden_share"), "ok": True}
        rows.append(guarded(f"prefill {n}", one) | {"tokens": n})
    return rows


def check_elastic(root: Path) -> dict:
    """Resize the cache on the GPU between decode steps: tokens as without, memory given back."""
    from hearth.engine import LLM
    from tests.test_elastic_cache import run_resizing

    path = root / "exec-qwen3_moe-float32"
    ref = run_resizing(LLM(path, device="cpu", expert_device="none"), PROMPTS, 24, {})
    llm = LLM(path, device="cuda", expert_device="cuda", expert_cache="1.0")
    reserved = [torch.cuda.memory_reserved()]
    tokens, logits = run_resizing(llm, PROMPTS, 24, {4: "0.1", 10: "0slots", 16: "1.0"})
    reserved.append(torch.cuda.memory_reserved())
    llm.engine.resize_expert_cache("0slots")
    reserved.append(torch.cuda.memory_reserved())
    llm.close()
    row = _compare(tokens, [x.float().cpu() for x in logits], ref, True)
    row["reserved_bytes"] = reserved
    row["ok"] = row["ok"] and reserved[2] <= reserved[1]
    return row
