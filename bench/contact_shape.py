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
# (cache fraction, its steps in order): plain steps, prefill, then fixed-shape steps, whose bucket
# compiles again after each resize (the slowest part; batch 4 fixed-shape at 1.0 only).
PHASES = (("1.0", (("off", 1), ("off", 4), ("fast", 1), ("fast", 4))),
          ("0.25", (("off", 1), ("off", 4), "prefill", ("fast", 1))),
          ("0.5", (("off", 1), ("off", 4))))
PROMPT_TOKENS, DECODE_STEPS = 72, 24  # with the warm-up's 48, every step in one block-table width (8 of 16)


def run_shape(rig: ex.Rig, record) -> None:
    """Build the model, then the phases; each figure is recorded as it is measured."""
    from bench.contact_rows import scratch
    from bench.shape_model import build_shape_model, remove_stale_pools
    from hearth.engine.experts.measure import measure_link_path

    remove_stale_pools()
    prefill = (256, 512) if rig.dry else (4096, 16384)
    # Built on the host (parallel threads): faster than the GPU's one pageable copy at a time.
    with build_shape_model(scratch() / "shape", DRY_SHAPE if rig.dry else None, device="cpu") as model:
        record({"check": "shape model built", "ok": None, "dense_bytes": model.dense_bytes,
                "expert_bytes": model.expert_bytes, "seconds": model.seconds})
        start = time.perf_counter()
        llm = shape_engine(rig, model, max(prefill))
        experts = llm.engine.experts
        # The DMA path (plain steps' fills, prefill streaming) measured once more, while the cache is
        # still empty (the measurement writes slots the tables do not use yet); the engine's own B_P
        # is the fill op's in graph mode.
        dma = measure_link_path(experts.device, llm.engine.pool, 8, path="copy").bytes_per_s
        record({"check": "shape engine loaded", "ok": None, "seconds": round(time.perf_counter() - start, 1),
                "slots": experts.tables.num_slots, "b_p_engine_GBps": _gbps(llm, "b_p"),
                "b_p_dma_GBps": dma / 1e9, "b_h_GBps": _gbps(llm, "b_h"),
                "link_path": getattr(experts, "link_path", None)})
        bandwidth = ex.read_rate(rig)
        try:
            for cache, steps in PHASES:
                record(ex.guarded(f"shape resize to {cache}", lambda c=cache: resize(llm, c)))
                for step in steps:
                    if step == "prefill":
                        for tokens in prefill:
                            record(ex.guarded(SHAPE_PREFILL.format(tokens=tokens), prefill_rate, llm, tokens,
                                              128 if rig.dry else 4096, dma) | {"tokens": tokens})
                        continue
                    mode, batch = ("off" if step[0] == "off" else rig.fast_mode), step[1]
                    check = SHAPE_DECODE.format(batch=batch, cache=cache, mode=mode)
                    record(ex.guarded(check, decode_rate, rig, llm, batch, mode, bandwidth, dma)
                           | {"batch": batch, "cache": cache, "static": mode})
        finally:
            llm.close()


def shape_engine(rig: ex.Rig, model, longest_prompt: int):
    """The engine over the shape model: fixed-shape steps on (graph on a GPU), the CPU experts in a
    worker process behind the task ring, the model's pool attached, no prefix cache (each run
    computes its prompt)."""
    from hearth.engine import LLM

    return LLM(model.path, device=rig.device, expert_device=rig.expert_device, static_decode=rig.fast_mode,
               expert_cache="1.0", max_model_len=longest_prompt + 64, max_num_seqs=max(BATCHES),
               prefill_chunk=128 if rig.dry else 4096, prefix_caching=False,
               # Prefill chunks stream whole layers (what the PCIe bound models); decode steps never do.
               stream_min_tokens=64 if rig.dry else 512, cpu_experts="process", **model.engine_options())


def resize(llm, cache: str) -> dict:
    report = llm.engine.resize_expert_cache(cache)
    return {"ok": None, **report}


def _gbps(llm, key: str) -> float | None:
    value = llm.engine.experts.stats().get(key)
    return value / 1e9 if value else None


def decode_rate(rig: ex.Rig, llm, batch: int, mode: str, bandwidth: float, dma: float) -> dict:
    """Decode tok/s of ``batch`` sequences stepping together, prefill left out (a warm run first:
    compiles, captures and brings the experts sampled tokens reach into the cache), next to the HBM
    and q* bounds of the bytes the measured steps moved."""
    engine = llm.engine
    static = engine.runner.static
    engine.runner.static = static if mode != "off" else None
    try:
        timed_steps(llm, batch, 2 * DECODE_STEPS)  # warm
        before = engine.experts.stats()
        seconds, steps = timed_steps(llm, batch, DECODE_STEPS)
        after = engine.experts.stats()
    finally:
        engine.runner.static = static
    tok_s = batch * steps / seconds
    b_p = dma if mode == "off" else after.get("b_p")  # plain steps fill by DMA, graph steps by the fill op
    return {"ok": True, "tok_s": tok_s, "steps": steps,
            **bounds(engine, before, after, steps, batch, bandwidth, tok_s, b_p)}


def timed_steps(llm, batch: int, tokens: int) -> tuple[float, int]:
    """Seconds of the decode steps of ``batch`` sampled requests (temperature 1) of ``tokens`` tokens
    each, and how many steps that was; their prefill runs first, untimed."""
    from hearth.engine import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    salt = time.perf_counter_ns()  # new prompts each run
    for i in range(batch):
        prompt = [(salt + 17 * i + 31 * j) % (vocab - 3) + 3 for j in range(PROMPT_TOKENS)]
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True))
    engine.step()  # the prefill of every prompt (one chunk), and each one's first token
    engine.experts.device.synchronize()
    start, steps = time.perf_counter(), 0
    for _ in range(4 * tokens):  # bounded: tokens - 1 steps are needed
        if not engine.has_unfinished():
            break
        engine.step()
        steps += 1
    engine.experts.device.synchronize()
    return time.perf_counter() - start, steps


def bounds(engine, before: dict, after: dict, steps: int, batch: int, bandwidth: float, tok_s: float,
           b_p: float | None) -> dict:
    """The HBM and q* bounds (tok/s) of the bytes a run of ``steps`` decode steps moved, from the
    cache's own counters (kept on the device, so fixed-shape steps count too): each distinct expert
    of a step read once from the slots; fills over ``b_p``, CPU experts over B_H."""
    from hearth.engine.executor.memory_plan import bytes_by_device

    model = engine.runner.model
    device = next(iter(k for k in bytes_by_device(model.parameters()) if k != "cpu"), "cpu")
    dense = bytes_by_device([*model.parameters(), *model.buffers()]).get(device, 0)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and embed.weight is not model.lm_head.weight:
        dense -= embed.weight.numel() * embed.weight.element_size()  # a step reads rows of it, not the table
    per = {k: (after.get(k, 0) - before.get(k, 0)) / max(steps, 1)
           for k in ("hits", "fills", "cpu", "prefill_streamed_steps")}
    expert = after["expert_bytes"]
    on_device = dense + (per["hits"] + per["fills"]) * expert  # each distinct expert of a step read once
    b_p, b_h = b_p or float("inf"), after.get("b_h") or float("inf")
    qstar = max(on_device / bandwidth, per["fills"] * expert / b_p, per["cpu"] * expert / b_h)
    hbm = on_device / bandwidth
    return {"hbm_bound_tok_s": batch / hbm, "hbm_share": tok_s * hbm / batch, "qstar_bound_tok_s": batch / qstar,
            "qstar_share": tok_s * qstar / batch, "dense_bytes": dense, "hits_per_step": per["hits"],
            "fills_per_step": per["fills"], "cpu_experts_per_step": per["cpu"],
            # Steps of at least the streaming threshold's tokens stream whole layers instead (no cache step).
            "streamed_share": per["prefill_streamed_steps"], "device_GBps": bandwidth / 1e9,
            "b_p_GBps": b_p / 1e9, "b_h_GBps": b_h / 1e9}


def prefill_rate(llm, tokens: int, chunk: int, dma: float) -> dict:
    """Prefill tok/s of one ``tokens``-long prompt next to the PCIe bound: each chunk moves every
    expert that is not resident across the link, by DMA at ``dma`` bytes/s (how streaming copies)."""
    from hearth.engine import SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    prompt = [(i * 31) % (vocab - 3) + 3 for i in range(tokens)]
    params = SamplingParams(max_tokens=1, temperature=0)
    other = [3 + (t - 2) % (vocab - 3) for t in prompt[: chunk + 8]]  # another prompt: nothing of it cached
    llm.generate([other], params)  # warm: one streamed chunk
    start = time.perf_counter()
    llm.generate([prompt], params)
    seconds = time.perf_counter() - start
    stats = engine.experts.stats()
    pool = engine.pool
    buffers = stats.get("prefill_buffers", 0) * pool.num_experts  # slots the streaming buffers take
    crossing = pool.nbytes * (1 - max(stats["slots"] - buffers, 0) / pool.gate_up.shape[0])
    bound = -(-tokens // chunk) * crossing / dma
    return {"ok": True, "tok_s": tokens / seconds, "pcie_bound_tok_s": tokens / bound if bound else None,
            "pcie_share": bound / seconds, "streamed_steps": stats.get("prefill_streamed_steps", 0),
            "hidden_share": stats.get("prefill_hidden_share")}
