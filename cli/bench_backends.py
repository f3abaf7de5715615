"""The backends ``hearth bench`` times (this engine in-process, transformers, a running server), and
the command that runs them (its flags and tables are in :mod:`hearth.cli.bench`).

Each returns a runner ``(depth, pp, tg) -> {"pp": tok/s, "tg": tok/s, "ttft": ms}`` for one
repetition (a key is absent when its test is skipped). All use greedy decoding, ignore EOS, and the
same prompt tokens: a real text (the standard library's ``argparse`` source) so that routing, and
so the expert cache, sees realistic input.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

from hearth.cli.bench import BenchRow, markdown, run_backend, validate
from hearth.engine import LLM, SamplingParams
from hearth.engine.checkpoint.demo import demo_model_dir
from hearth.engine.checkpoint.dispatch import load_config
from hearth.engine.checkpoint.inspect import human_bytes, summarize

DEFAULT_URL_TIMEOUT_S = 600


def timed_steps(engine, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds of each engine step of one greedy request, until it finishes."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    times = []
    while True:
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        if any(o.finished for o in outs if o.request_id == rid):
            return times


def prompt_ids(tokenizer, length: int) -> list[int]:
    """``length`` token ids of real text (repeated if the text is short)."""
    ids = tokenizer.encode(inspect.getsource(argparse), add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


@contextlib.contextmanager
def engine_runner(model: str, dtype: str, max_len: int, n_prompt: int, options: dict) -> Iterator:
    """This engine, one request at a time; the pp chunk is exactly one engine step."""
    if options.get("expert_device") == "auto":
        options = dict(options, expert_device="cuda" if torch.cuda.is_available() else "virtual")
    chunk = max(n_prompt, 16)
    # Every repetition sends the same prompt: a prefix cache would serve the later ones from memory.
    options = {"prefix_caching": False, **options}
    llm = LLM(model, dtype=dtype, max_model_len=max_len, max_num_seqs=1, prefill_chunk=chunk,
              max_num_batched_tokens=max(chunk, 2048), **options)
    engine = llm.engine
    ids = prompt_ids(llm.tokenizer, max_len)

    def run(depth: int, pp: int, tg: int) -> dict[str, float]:
        result = {}
        if pp:
            before = engine.stats().get("experts", {})
            times = timed_steps(engine, ids[: depth + pp], 1)
            result["pp"] = pp / times[-1]  # the last prefill step is the pp chunk (depth % pp == 0)
            result["ttft"] = sum(times) * 1e3
            after = engine.stats().get("experts", {})
            copied = after.get("prefill_copy_seconds", 0.0) - before.get("prefill_copy_seconds", 0.0)
            if copied > 0:  # the prompt streamed whole layers: how much of the copying compute hid
                waited = after["prefill_wait_seconds"] - before["prefill_wait_seconds"]
                result["copy_hidden"] = 1.0 - min(waited / copied, 1.0)
        if tg:
            times = timed_steps(engine, ids[: max(depth, 1)], tg + 1)
            result["tg"] = tg / sum(times[-tg:])  # the last tg steps are decode steps
        return result

    try:
        yield run
    finally:
        llm.close()


def transformers_runner(model: str, dtype: str):
    """Hugging Face transformers (eager, its own KV cache) on the same checkpoint."""
    # deferred: transformers takes about a second to import, and only --transformers needs it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = "auto" if dtype in ("auto", None) else getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
    tok = AutoTokenizer.from_pretrained(model)

    @torch.inference_mode()
    def run(depth: int, pp: int, tg: int) -> dict[str, float]:
        ids = torch.tensor([prompt_ids(tok, depth + max(pp, 1))])
        result = {}
        if pp:
            start = time.perf_counter()
            past = hf(ids[:, :depth], use_cache=True).past_key_values if depth else None
            mid = time.perf_counter()
            logits = hf(ids[:, depth:depth + pp], past_key_values=past, use_cache=True).logits
            int(logits[0, -1].argmax())
            end = time.perf_counter()
            result["pp"], result["ttft"] = pp / (end - mid), (end - start) * 1e3
        if tg:
            out = hf(ids[:, : max(depth, 1)], use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(tg):
                out = hf(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            result["tg"] = tg / (time.perf_counter() - start)
        return result

    return run


def url_runner(url: str, api_key: str | None):
    """A running hearth server through ``/v1/completions`` (streamed): TTFT measured here, pp and tg
    from the server's ``timings``. Prompts are token ids below 232, valid in any byte-level vocabulary."""
    base = url.rstrip("/")
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    with urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=headers), timeout=30) as r:
        name = json.load(r)["data"][0]["id"]

    def stream(prompt: list[int], max_tokens: int) -> tuple[float, dict]:
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(), headers=headers)
        start, first, timings = time.perf_counter(), None, {}
        with urllib.request.urlopen(req, timeout=DEFAULT_URL_TIMEOUT_S) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"server error: {event['error']}")
                if first is None and event.get("choices"):
                    first = time.perf_counter()
                timings = event.get("timings") or timings
        return ((first or time.perf_counter()) - start) * 1e3, timings

    def run(depth: int, pp: int, tg: int) -> dict[str, float]:
        ids = [32 + (i * 37) % 200 for i in range(depth + max(pp, 1))]
        result = {}
        if pp:
            result["ttft"], timings = stream(ids[: depth + pp], 1)
            result["pp"] = float(timings.get("prompt_per_second", 0.0))
        if tg:
            _, timings = stream(ids[: max(depth, 1)], tg + 1)
            result["tg"] = float(timings.get("predicted_per_second", 0.0))
        return result

    return name, run


def cmd_bench(args: argparse.Namespace) -> int:
    """``hearth bench``: every backend asked for, then the table (or JSON) of their rows."""
    validate(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": {k: v for k, v in vars(args).items()
                                                                 if k not in ("api_key", "func")}}
    rows: list[BenchRow] = []
    if args.url:
        name, runner = url_runner(args.url, args.api_key)
        rows += run_backend("server", name, runner, args)
    else:
        if args.model is None:
            args.model = str(demo_model_dir())
        model = Path(args.model).name
        max_len = max(args.depth) + args.n_prompt + args.n_gen + 8
        with engine_runner(args.model, args.dtype, max_len, args.n_prompt, {}) as runner:
            rows += run_backend("hearth", model, runner, args)
        for fraction in args.cache_fraction or []:
            opts = {"expert_device": "auto", "expert_cache": fraction, "virtual_link_gbps": args.virtual_link_gbps,
                    "double_buffer": not args.no_double_buffer, "stream_min_tokens": args.stream_min_tokens}
            with engine_runner(args.model, args.dtype, max_len, args.n_prompt, opts) as runner:
                rows += run_backend(f"hearth cache {fraction:g}", model, runner, args)
        if args.transformers:
            rows += run_backend("transformers", model, transformers_runner(args.model, args.dtype), args)
    result = {**meta, "rows": [r.to_json() for r in rows]}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    if args.output == "json":
        print(json.dumps(result, indent=2, default=str))
    else:
        print(markdown(rows) + ("" if args.url else "\n\n" + kv_note(args.model, args.dtype)))
    return 0


def kv_note(model: str, dtype: str) -> str:
    """The model's KV cache bytes per token (and, for latent attention, what expanded K/V would take)."""
    s = summarize(load_config(model, None if dtype == "auto" else dtype)[1])
    note = f"KV cache per token: {human_bytes(s.kv_bytes_per_token)}"
    if s.expanded_kv_bytes_per_token:
        ratio = s.expanded_kv_bytes_per_token / s.kv_bytes_per_token
        note += (f" (latent + rotary key), against {human_bytes(s.expanded_kv_bytes_per_token)} of expanded "
                 f"per-head K/V: {ratio:.1f}x smaller")
    return note
