"""Rows c and d of the GPU contact check: decode and prefill on Qwen3-30B-A3B's exact shapes.

One engine over a random model of that shape (``bench/shape_model.py``: 48 layers, 128 experts
top-8, vocab 151,936, bf16; the experts in a filled shared pool the engine attaches to). Its
expert cache is resized between phases (elastic VRAM), and plain steps are compared with
fixed-shape steps on the same engine by switching its fixed-shape decoder off and on. Phases, most
important first: cache 1.0 (plain, then graph: the HBM target), 0.25 (the q* target), prefill of
4k and 16k tokens at 0.25 (the PCIe target), then 0.5. Each decode figure is next to two bounds:

- HBM: the bytes a step reads on the GPU (the dense weights once, each distinct expert it uses
  once, from the slots) over the GPU's measured copy rate;
- q*: the split model's, the largest of the device's share (dense + hit + filled experts over the
  GPU's rate), filled bytes over B_P and CPU-expert bytes over B_H, with the B_P and B_H the engine
  measured at start in this run (its q table's).

Decode samples (temperature 1): greedy decoding of random weights soon repeats one token, whose
experts a warm cache then always holds.
"""

from __future__ import annotations

import time

from bench import gpu_executor as ex
from bench.contact_targets import SHAPE_DECODE, SHAPE_PREFILL

DRY_SHAPE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
             "intermediate_size": 512, "vocab_size": 4096}
BATCHES = (1, 4)


def run_shape(rig: ex.Rig, record) -> None:
    """Build the model, then the phases; each figure is recorded as it is measured."""
    from bench.contact_rows import scratch
    from bench.shape_model import build_shape_model, remove_stale_pools

    remove_stale_pools()
    prefill = (256, 512) if rig.dry else (4096, 16384)
    with build_shape_model(scratch() / "shape", DRY_SHAPE if rig.dry else None,
                           device="cpu" if rig.dry else "cuda") as model:
        record({"check": "shape model built", "ok": None, "dense_bytes": model.dense_bytes,
                "expert_bytes": model.expert_bytes, "seconds": model.seconds})
        start = time.perf_counter()
        llm = shape_engine(rig, model, max(prefill))
        record({"check": "shape engine loaded", "ok": None, "seconds": round(time.perf_counter() - start, 1),
                "slots": llm.engine.experts.tables.num_slots, "b_p_GBps": _gbps(llm, "b_p"),
                "b_h_GBps": _gbps(llm, "b_h")})
        bandwidth = ex.read_rate(rig)
        try:
            for cache in ("1.0", "0.25", "0.5"):
                record(ex.guarded(f"shape resize to {cache}", lambda c=cache: resize(llm, c)))
                # Plain steps first, then prefill (no compiles), then fixed-shape steps: each bucket
                # compiles again after a resize, the slowest part, so it comes last in each phase.
                for mode in ("off", "prefill", rig.fast_mode):
                    if mode == "prefill":
                        for tokens in prefill if cache == "0.25" else ():
                            record(ex.guarded(SHAPE_PREFILL.format(tokens=tokens), prefill_rate, llm, tokens,
                                              128 if rig.dry else 4096) | {"tokens": tokens})
                        continue
                    for batch in BATCHES:
                        check = SHAPE_DECODE.format(batch=batch, cache=cache, mode=mode)
                        record(ex.guarded(check, decode_rate, rig, llm, batch, mode, bandwidth)
                               | {"batch": batch, "cache": cache, "static": mode})
        finally:
            llm.close()


def shape_engine(rig: ex.Rig, model, longest_prompt: int):
    """The engine over the shape model: fixed-shape steps on (graph on a GPU), the CPU experts in a
    worker process behind the task ring, the model's pool attached."""
    from hearth.engine import LLM

    options = {"cpu_experts": "process"} if rig.fast_mode == "graph" else {}
    return LLM(model.path, device=rig.device, expert_device=rig.expert_device, static_decode=rig.fast_mode,
               expert_cache="1.0", max_model_len=longest_prompt + 64, max_num_seqs=max(BATCHES),
               prefill_chunk=128 if rig.dry else 4096, **model.engine_options(), **options)


def resize(llm, cache: str) -> dict:
    report = llm.engine.resize_expert_cache(cache)
    return {"ok": None, **report}


def _gbps(llm, key: str) -> float | None:
    value = llm.engine.experts.stats().get(key)
    return value / 1e9 if value else None


def decode_rate(rig: ex.Rig, llm, batch: int, mode: str, bandwidth: float) -> dict:
    """tok/s of ``batch`` sequences decoding together (a warm run first: compiles, captures and
    fills the cache), next to the HBM and q* bounds of the bytes the measured run moved."""
    from hearth.engine import SamplingParams

    engine = llm.engine
    static, steps = engine.runner.static, 8 if rig.dry else 48
    engine.runner.static = static if mode != "off" else None
    try:
        vocab = engine.model_config.vocab_size
        prompts = [[(17 * i + 31 * j) % (vocab - 3) + 3 for j in range(32)] for i in range(batch)]
        params = SamplingParams(max_tokens=steps, temperature=1.0, ignore_eos=True)
        # Warm, twice as long: compiles and captures, and brings the experts sampled tokens reach into
        # the cache (at 1.0 the measured run then reads them all from the slots).
        llm.generate(prompts, SamplingParams(max_tokens=2 * steps, temperature=1.0, ignore_eos=True))
        before = engine.experts.stats()
        rig.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        after = engine.experts.stats()
    finally:
        engine.runner.static = static
    return {"ok": True, "tok_s": batch * steps / seconds, **bounds(engine, before, after, steps, batch, bandwidth,
                                                                    batch * steps / seconds)}


def bounds(engine, before: dict, after: dict, steps: int, batch: int, bandwidth: float, tok_s: float) -> dict:
    """The HBM and q* bounds (tok/s) of the bytes a run of ``steps`` decode steps moved."""
    from hearth.engine.memory import bytes_by_device

    model = engine.runner.model
    device = next(iter(k for k in bytes_by_device(model.parameters()) if k != "cpu"), "cpu")
    dense = bytes_by_device([*model.parameters(), *model.buffers()]).get(device, 0)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and embed.weight is not model.lm_head.weight:
        dense -= embed.weight.numel() * embed.weight.element_size()  # a step reads rows of it, not the table
    per = {k: (after.get(k, 0) - before.get(k, 0)) / steps
           for k in ("hits", "fills", "cpu", "fill_bytes", "cpu_bytes", "prefill_streamed_steps")}
    expert = after["expert_bytes"]
    on_device = dense + (per["hits"] + per["fills"]) * expert  # each distinct expert of a step read once
    b_p, b_h = after.get("b_p") or float("inf"), after.get("b_h") or float("inf")
    qstar = max(on_device / bandwidth, per["fill_bytes"] / b_p, per["cpu_bytes"] / b_h)
    hbm = on_device / bandwidth
    return {"hbm_bound_tok_s": batch / hbm, "hbm_share": tok_s * hbm / batch, "qstar_bound_tok_s": batch / qstar,
            "qstar_share": tok_s * qstar / batch, "dense_bytes": dense, "hits_per_step": per["hits"],
            "fills_per_step": per["fills"], "cpu_experts_per_step": per["cpu"],
            # Steps of at least the streaming threshold's tokens stream whole layers instead (no cache step).
            "streamed_share": per["prefill_streamed_steps"], "device_GBps": bandwidth / 1e9,
            "b_p_GBps": b_p / 1e9, "b_h_GBps": b_h / 1e9}


def prefill_rate(llm, tokens: int, chunk: int) -> dict:
    """Prefill tok/s of one ``tokens``-long prompt next to the PCIe bound: each chunk moves every
    expert that is not resident across the link, at the B_P the engine measured."""
    from hearth.engine import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompt = [(i * 31) % (vocab - 3) + 3 for i in range(tokens)]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prompt[: chunk + 8]], params)  # warm: one streamed chunk
    start = time.perf_counter()
    llm.generate([prompt], params)
    seconds = time.perf_counter() - start
    stats = engine.experts.stats()
    pool = engine.pool
    buffers = stats.get("prefill_buffers", 0) * pool.num_experts  # slots the streaming buffers take
    crossing = pool.nbytes * (1 - max(stats["slots"] - buffers, 0) / pool.gate_up.shape[0])
    bound = -(-tokens // chunk) * crossing / (stats.get("b_p") or float("inf"))
    return {"ok": True, "tok_s": tokens / seconds, "pcie_bound_tok_s": tokens / bound if bound else None,
            "pcie_share": bound / seconds, "streamed_steps": stats.get("prefill_streamed_steps", 0),
            "hidden_share": stats.get("prefill_hidden_share")}
