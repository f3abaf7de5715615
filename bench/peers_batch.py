"""Batched decode on one GGUF file: N concurrent streams against one, for hearth and llama.cpp.

``python bench/peers.py batch FILE`` (the ``batch`` command of peers.py) runs this. Per round, each
engine decodes ``--tokens`` tokens for one stream and then for ``--streams`` streams together
(greedy, the same synthetic prompts); the medians give the aggregate speedup. hearth's batched steps
are also expressed as bytes read per second: the dense weights plus the distinct experts each step
routes to (counted in a separate run of the module path), over the machine's measured read rate.

Two more figures put that share in context:
- ``--peer``: llama.cpp decodes the same streams in a process of its own (its low-level batch API,
  one sequence id per stream), interleaved with hearth's rounds, and its step is put through the
  same bytes accounting (hearth's distinct-expert count: the prompts are the same and the routing
  of random weights alike, but llama.cpp's tokens are its own, so its figure is an estimate).
- the expert kernel alone: hearth's routed-expert kernel over every MoE layer's real banks, with
  random routing for ``--streams`` tokens, timed call by call with the cache flushed before each
  pass. Its bytes per second bound what a whole step (which adds attention, the dense products,
  the head and Python) can reach.

``--flush-cache`` evicts the last-level cache before every timed step (untimed), so that every step
reads its weights from DRAM as any model much larger than the cache does.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

from bench.common import emit, last_level_cache, machine_facts, read_rate, synthetic_prompt, worker_process


def _flush_floats() -> int:
    """fp32 elements of a buffer whose reading evicts the last-level cache (twice its size)."""
    return max(2 * last_level_cache(), 256 << 20) // 4


def _flusher():
    """A function that evicts the last-level cache by reading a buffer twice its size."""
    import torch

    scratch = torch.ones(_flush_floats(), dtype=torch.float32)
    return lambda: scratch.sum()


def _decode_steps(engine, prompts: list[list[int]], tokens: int, flush=None) -> tuple[list[float], int]:
    """Seconds of each pure decode step while ``prompts`` decode together (prefill steps left out), and
    the tokens those steps produced; ``flush`` (untimed) runs before each step."""
    from hearth.engine import SamplingParams

    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    times, produced = [], 0
    while engine.has_unfinished():
        if flush is not None:
            flush()
        prefilling = any(r.num_computed < r.num_tokens - 1 for r in engine._requests.values())
        start = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            times.append(time.perf_counter() - start)
            produced += len(outs)
    return times, produced


def _distinct_experts(path: Path, dtype: str, prompts: list[list[int]], tokens: int, n_ctx: int) -> list[int]:
    """Per decode step, the distinct experts the batch routes to (summed over MoE layers), from a run
    with the module path (whose routers are visible from Python; the routing is the native path's)."""
    import os
    from unittest import mock

    from hearth.engine import LLM
    from hearth.engine.layers.moe import TopKRouter

    counts: list[int] = []
    select = TopKRouter.select

    def counted(self, logits):
        ids, weights = select(self, logits)
        if logits.shape[0] == len(prompts):  # a decode step of the whole batch
            counts.append(int(ids.unique().numel()))
        return ids, weights

    with mock.patch.dict(os.environ, {"HEARTH_NATIVE_LAYERS": "0"}), mock.patch.object(TopKRouter, "select", counted):
        llm = LLM(str(path), dtype=dtype, max_model_len=n_ctx, max_num_seqs=len(prompts), prefix_caching=False)
        try:
            _decode_steps(llm.engine, prompts, tokens)
        finally:
            llm.close()
    layers = len(llm.engine.model_config.moe_layer_ids)
    return [sum(counts[i : i + layers]) for i in range(0, len(counts) - layers + 1, layers)]


def _expert_kernel_rate(engine, tokens: int, passes: int, flush) -> float:
    """Bytes per second of the routed-expert kernel alone over every MoE layer's banks: ``tokens``
    tokens with random top-k routing, the cache flushed (when ``flush``) before each pass over the
    layers, each call timed (distinct experts' bytes over the summed call times)."""
    import torch

    from hearth.engine.kernels.cpu import cpu_decode_ops

    ops, pool, cfg = cpu_decode_ops(), engine.pool, engine.model_config
    if ops is None or not pool.blocks:
        return float("nan")
    k, experts = cfg.top_k, cfg.num_experts
    x = torch.randn(tokens, cfg.hidden_size)
    weights = torch.full((tokens, k), 1.0 / k)
    gen = torch.Generator().manual_seed(0)
    read, spent = 0, 0.0
    for _ in range(passes):
        if flush is not None:
            flush()
        for layer in cfg.moe_layer_ids:
            blocks, base = pool.blocks[layer], pool.layer_rows(layer)
            rows = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
            gate_up, down = pool.gate_up[base : base + experts], pool.down[base : base + experts]
            start = time.perf_counter()
            ops.experts_blocks(x, gate_up, down, rows, weights, blocks.gate_up.name, blocks.down.name,
                               blocks.inter, blocks.int8_activations)
            spent += time.perf_counter() - start
            read += rows.unique().numel() * (blocks.gate_up_bytes + blocks.down_bytes)
    return read / spent


def _llama_cpp_batch_worker(conn, path: str, threads: int, streams: int, n_ctx: int, flush_cache: bool) -> None:
    """llama.cpp in a process of its own: answers (n, prompt_len, tokens) with (tok/s, median step
    seconds) for n streams decoding together, greedy, through its batch API."""
    import llama_cpp as ll
    import numpy as np

    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(path.encode(), ll.llama_model_default_params())
    params = ll.llama_context_default_params()
    # The sequences share one KV cache: n_ctx holds all of them, and one batch holds all their prompts.
    capacity = max(512, n_ctx)
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = capacity, capacity, 512, streams
    params.n_threads = params.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    batch = ll.llama_batch_init(capacity, 0, streams)
    scratch = np.ones(_flush_floats(), dtype=np.float32) if flush_cache else None

    def decode(items: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, logits)
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, int(logits)
        if ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, i), shape=(vocab,))))

    conn.send("ready")
    while (job := conn.recv()) is not None:
        n, length, tokens = job
        ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
        prompts = [synthetic_prompt(vocab, length, salt) for salt in range(n)]
        decode([(t, p, s, p == length - 1) for s in range(n) for p, t in enumerate(prompts[s])])
        nxt = [greedy(length * s + length - 1) for s in range(n)]
        times = []
        for step in range(tokens):
            if scratch is not None:
                scratch.sum()
            start = time.perf_counter()
            decode([(nxt[s], length + step, s, True) for s in range(n)])
            nxt = [greedy(s) for s in range(n)]
            times.append(time.perf_counter() - start)
        conn.send((n * len(times) / sum(times), statistics.median(times)))
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


def batch(args: argparse.Namespace) -> int:
    """Aggregate decode of ``--streams`` concurrent sequences against one, interleaved in rounds (with
    llama.cpp alongside under ``--peer``), and the bytes per second hearth's batched steps read as a
    share of the measured memory read rate."""
    import torch

    from hearth.engine import LLM

    torch.set_num_threads(args.threads)
    roofline = read_rate()
    path = args.file
    dtype = args.dtype or "float32"  # GGUF's default (bf16 weights stay bf16 blocks)
    n_ctx = args.prompt + args.tokens + 64
    one, many, peer_one, peer_many = [], [], [], []
    with contextlib.ExitStack() as stack:
        peer = None
        if args.peer:  # llama.cpp: (streams, prompt length, tokens) -> (tok/s, median step s)
            peer = stack.enter_context(worker_process(
                _llama_cpp_batch_worker, str(path), args.threads, args.streams,
                args.streams * (args.prompt + args.tokens) + 64, args.flush_cache,
                failure=f"llama.cpp could not load {path}"))
        llm = LLM(str(path), dtype=dtype, max_model_len=n_ctx, max_num_seqs=args.streams, prefix_caching=False,
                  int8_activations=args.int8_activations)
        stack.callback(llm.close)
        engine = llm.engine
        vocab = engine.model_config.vocab_size
        prompts = [synthetic_prompt(vocab, args.prompt, salt) for salt in range(args.streams)]
        dense = sum(p.nbytes for n, p in engine.runner.model.named_parameters() if "embed_tokens" not in n)
        blocks = engine.pool.blocks or {}
        expert_bytes = statistics.mean(b.gate_up_bytes + b.down_bytes for b in blocks.values()) if blocks \
            else engine.pool.expert_bytes
        flush = _flusher() if args.flush_cache else None
        _decode_steps(engine, prompts[:1], 8)  # warm-up
        if peer is not None:
            peer((1, args.prompt, 8))  # warm-up
        for _ in range(args.rounds):
            times, n = _decode_steps(engine, prompts[:1], args.tokens, flush)
            one.append(n / sum(times))
            times, n = _decode_steps(engine, prompts, args.tokens, flush)
            many.append((n / sum(times), statistics.median(times)))
            if peer is not None:
                peer_one.append(peer((1, args.prompt, args.tokens)))
                peer_many.append(peer((args.streams, args.prompt, args.tokens)))
        kernel_rate = _expert_kernel_rate(engine, args.streams, 8, flush or _flusher())
    experts = statistics.median(_distinct_experts(path, dtype, prompts, args.tokens, n_ctx))
    experts_one = statistics.median(_distinct_experts(path, dtype, prompts[:1], args.tokens, n_ctx))
    step = statistics.median(t for _, t in many)
    step_bytes = dense + experts * expert_bytes
    one_bytes = dense + experts_one * expert_bytes  # per token of one stream
    result = {"machine": machine_facts(), "file": str(path), "streams": args.streams, "threads": args.threads,
              "rounds": args.rounds,
              "int8_activations": args.int8_activations, "flush_cache": args.flush_cache,
              "read_rate_gb_s": roofline / 1e9,
              "one_stream_tok_s": statistics.median(one), "aggregate_tok_s": statistics.median(t for t, _ in many),
              "distinct_experts_per_step": experts, "bytes_per_step": step_bytes,
              "bytes_per_s": step_bytes / step, "roofline_share": step_bytes / step / roofline,
              "expert_kernel_bytes_per_s": kernel_rate, "expert_kernel_roofline_share": kernel_rate / roofline,
              "last_level_cache_bytes": last_level_cache()}
    result["speedup"] = result["aggregate_tok_s"] / result["one_stream_tok_s"]
    # One stream's rate against the same roofline: above 1 where a large last-level cache holds part
    # of the weights from one token to the next (the roofline is read from a 1 GiB buffer, from DRAM).
    result["one_stream_bytes_per_s"] = one_bytes * result["one_stream_tok_s"]
    result["one_stream_roofline_share"] = result["one_stream_bytes_per_s"] / roofline
    if args.peer:
        peer_step = statistics.median(s for _, s in peer_many)
        result["llama_cpp"] = {"one_stream_tok_s": statistics.median(t for t, _ in peer_one),
                               "aggregate_tok_s": statistics.median(t for t, _ in peer_many),
                               "step_s": peer_step, "bytes_per_s_estimate": step_bytes / peer_step,
                               "roofline_share_estimate": step_bytes / peer_step / roofline}
        peer_result = result["llama_cpp"]
        peer_result["speedup"] = peer_result["aggregate_tok_s"] / peer_result["one_stream_tok_s"]
    _print(result, args)
    emit(result, args.json)
    return 0


def _print(result: dict, args: argparse.Namespace) -> None:
    gb, roofline = 1e9, result["read_rate_gb_s"]
    print(f"\n{Path(result['file']).name}: {args.streams} streams vs 1, {args.threads} threads, median of "
          f"{args.rounds} rounds{' (int8 activations)' if args.int8_activations else ''}"
          f"{', cache flushed before each step' if args.flush_cache else ''}")
    print(f"  hearth: one stream {result['one_stream_tok_s']:.1f} tok/s; {args.streams} streams "
          f"{result['aggregate_tok_s']:.1f} tok/s aggregate ({result['speedup']:.2f}x)")
    print(f"  a batched step reads {result['bytes_per_step'] / 1e6:.0f} MB ({result['distinct_experts_per_step']:.0f} "
          f"distinct experts + dense weights): {result['bytes_per_s'] / gb:.1f} GB/s, "
          f"{100 * result['roofline_share']:.0f} % of the measured {roofline:.1f} GB/s")
    llc = result["last_level_cache_bytes"]
    cache = f" (last-level cache {llc >> 20} MiB)" if llc else ""
    print(f"  one stream: {result['one_stream_bytes_per_s'] / gb:.1f} GB/s, "
          f"{100 * result['one_stream_roofline_share']:.0f} % of it{cache}")
    print(f"  the expert kernel alone ({args.streams} tokens, cache flushed): "
          f"{result['expert_kernel_bytes_per_s'] / gb:.1f} GB/s, {100 * result['expert_kernel_roofline_share']:.0f} %")
    if "llama_cpp" in result:
        p = result["llama_cpp"]
        print(f"  llama.cpp: one stream {p['one_stream_tok_s']:.1f} tok/s; {args.streams} streams "
              f"{p['aggregate_tok_s']:.1f} ({p['speedup']:.2f}x); its step at the same bytes "
              f"{p['bytes_per_s_estimate'] / gb:.1f} GB/s, {100 * p['roofline_share_estimate']:.0f} % (estimate)")
