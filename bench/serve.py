"""Serving latency: TTFT and inter-token latency for N concurrent streaming clients, and the cost
of the HTTP path against calling the engine in-process.

The server runs as ``hearth serve`` in a subprocess (as users run it); clients stream
``/v1/completions`` from threads of this process. For N = 1 the same request also runs through
``engine.LLM`` in this process, alternating run by run, so the HTTP overhead is a ratio of
medians taken side by side.

    python bench/serve.py --model DIR [--prompt-len 128] [--gen 64] [--runs 5] [--clients 1 4 8]
    python bench/serve.py --build-random /tmp/qwen3-1b      # the ~1B random Qwen3-MoE of bench/decode.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, synthetic_prompt  # noqa: E402
from bench.decode import build_random  # noqa: E402
from hearth.engine import LLM, SamplingParams  # noqa: E402
from hearth.serving.server import free_port  # noqa: E402


def start_server(model: Path, dtype: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hearth.cli.main", "serve", "--model", str(model), "--port", str(port),
           "--grpc-port", "0", "--dtype", dtype, "--served-model-name", "bench", "--log-format", "text"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready")


def stream_once(url: str, prompt: list[int], gen: int) -> dict:
    """One streaming completion: TTFT, the gaps between chunks, and client-side decode tok/s."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": gen, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data["choices"] and data["choices"][0].get("token_ids"):
                arrivals.append(time.perf_counter())  # one chunk per engine step (token), text or not
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    decode_s = arrivals[-1] - arrivals[0]
    return {"ttft_s": arrivals[0] - start, "itl_s": statistics.median(gaps) if gaps else 0.0, "gaps": gaps,
            "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else 0.0, "tokens": tokens}


def concurrent(url: str, prompts: list[list[int]], gen: int) -> list[dict]:
    results: list[dict | None] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = stream_once(url, prompts[i], gen)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results  # type: ignore[return-value]


def in_process(llm: LLM, prompt: list[int], gen: int) -> dict:
    out = llm.generate(prompt, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True))[0]
    m = out.metrics
    return {"ttft_s": m.first_token - m.arrival, "decode_tok_s": (gen - 1) / (m.finished - m.first_token)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--build-random", type=Path, help="build (once) and use the ~1B random Qwen3-MoE here")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    model = args.model
    if args.build_random:
        build_random(args.build_random, args.dtype)
        model = args.build_random
    if model is None:
        ap.error("give --model or --build-random")
    threads = os.environ.get("OMP_NUM_THREADS")
    port = free_port()
    server = start_server(model, args.dtype, port)
    url = f"http://127.0.0.1:{port}"
    try:
        llm = LLM(model, dtype=args.dtype)
        vocab = llm.engine.model_config.vocab_size
        prompts = [synthetic_prompt(vocab, args.prompt_len + i) for i in range(max(args.clients))]
        stream_once(url, prompts[0], 4)  # warm up both paths
        in_process(llm, prompts[0], 4)
        result = {"model": str(model), "dtype": args.dtype, "prompt_len": args.prompt_len, "gen": args.gen,
                  "runs": args.runs, "omp_threads": threads, "levels": {}}
        direct, http = [], []
        for _ in range(args.runs):  # N = 1, alternating in-process and HTTP
            direct.append(in_process(llm, prompts[0], args.gen))
            http.append(stream_once(url, prompts[0], args.gen))
        llm.close()
        result["in_process"] = summarize(direct)
        for n in args.clients:
            runs = http if n == 1 else [r for _ in range(args.runs) for r in concurrent(url, prompts[:n], args.gen)]
            result["levels"][str(n)] = summarize(runs)
        pairs = [1 - h["decode_tok_s"] / d["decode_tok_s"] for d, h in zip(direct, http, strict=True)]
        result["http_decode_slowdown_per_pair"] = pairs
        one = result["levels"].get("1")
        if one:
            result["http_decode_slowdown"] = 1 - one["decode_tok_s"] / result["in_process"]["decode_tok_s"]
            result["http_decode_slowdown_median_pair"] = statistics.median(pairs)
            result["http_ttft_overhead_s"] = one["ttft_s"] - result["in_process"]["ttft_s"]
    finally:
        server.terminate()
        server.wait(60)
    print_table(result)
    emit(result, args.json)


def summarize(runs: list[dict]) -> dict:
    out = {key: statistics.median(r[key] for r in runs) for key in ("ttft_s", "decode_tok_s")}
    if "itl_s" in runs[0]:
        gaps = sorted(g for r in runs for g in r["gaps"])
        out["itl_s"] = statistics.median(gaps)
        out["itl_p90_s"] = gaps[int(0.9 * (len(gaps) - 1))]
    out["samples"] = len(runs)
    return out


def print_table(result: dict) -> None:
    print(f"model {result['model']} ({result['dtype']}), prompt {result['prompt_len']}, generate {result['gen']}, "
          f"median of {result['runs']} runs", file=sys.stderr)
    print("| path | clients | TTFT ms | ITL ms (p50 / p90) | decode tok/s per stream |", file=sys.stderr)
    print("|---|---|---|---|---|", file=sys.stderr)
    d = result["in_process"]
    print(f"| in-process | 1 | {d['ttft_s'] * 1e3:.1f} | - | {d['decode_tok_s']:.2f} |", file=sys.stderr)
    for n, r in result["levels"].items():
        print(f"| HTTP | {n} | {r['ttft_s'] * 1e3:.1f} | {r['itl_s'] * 1e3:.1f} / {r['itl_p90_s'] * 1e3:.1f} | "
              f"{r['decode_tok_s']:.2f} |", file=sys.stderr)
    if "http_decode_slowdown" in result:
        print(f"HTTP decode slowdown at N=1: {result['http_decode_slowdown']:+.1%} (ratio of medians), "
              f"{result['http_decode_slowdown_median_pair']:+.1%} (median of run pairs); "
              f"TTFT overhead {result['http_ttft_overhead_s'] * 1e3:+.1f} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
