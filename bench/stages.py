"""Pipeline stages on two Ray nodes of this machine (127.0.0.2): the cost of a stage hop, and
decode speed of a two-stage split against one machine, through the router's API.

    python bench/stages.py [--model DIR | --build-random DIR] [--gen 64] [--runs 3] [--json out.json]

The hop: a Ray call that carries one decode step's batch and hidden states [1, H] to an actor on
the other node and back (what the first stage does each step, without the later stage's compute).
Decode: the same greedy request against one replica on one node, then against the model split
over both nodes (``DeployOptions(stages=True)``); tok/s from the time between the first and the
last token of a streamed reply. Both nodes share this machine's cores, so the split cannot run
faster here; it shows the overhead the hop and the stage boundary add.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402


def hop_cost(hidden_size: int, repeats: int) -> float:
    """Median seconds of one round trip of a 1-token batch and its hidden states to the other node."""
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from hearth.engine.executor.runner import build_batch
    from hearth.engine.request import Request
    from hearth.engine.sampling import SamplingParams

    @ray.remote(num_cpus=0)
    class Echo:
        def forward(self, batch, hidden):
            return hidden

    other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "laptop" in n["Resources"])
    echo = Echo.options(scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False)).remote()
    req = Request("r", list(range(100)), SamplingParams())
    req.block_table, req.num_computed = list(range(8)), 99
    batch, _ = build_batch([(req, 1)], 16)
    hidden = torch.randn(1, hidden_size, dtype=torch.bfloat16)
    ray.get(echo.forward.remote(batch, hidden))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        ray.get(echo.forward.remote(batch, hidden))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_speed(url: str, gen: int) -> float:
    """tok/s between the first and the last streamed token of one greedy request."""
    import requests

    body = {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": gen, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    first = last = None
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and (chunk["choices"][0].get("token_ids") or chunk["choices"][0].get("text")):
                    last = time.perf_counter()
                    first = first or last
    return (gen - 1) / (last - first)


def concurrent_speed(url: str, gen: int, streams: int) -> float:
    """Tokens per second over ``streams`` greedy requests at once (all their tokens over the wall time)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    body = {"model": "m", "prompt": "def fibonacci(n):", "max_tokens": gen, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        for reply in pool.map(lambda _: requests.post(f"{url}/v1/completions", json=body, timeout=600),
                              range(streams)):
            reply.raise_for_status()
    return streams * gen / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--build-random", type=Path, help="a ~1B random Qwen3-MoE here (built if absent)")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=4, help="streams for the throughput test (0: skip)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.build_random:
        from bench.decode import build_random

        build_random(args.build_random, "bfloat16")
        args.model = args.build_random
    if args.model is None:
        ap.error("give --model or --build-random")
    import ray
    from ray.cluster_utils import Cluster

    from hearth.cluster.deploy import deploy
    from hearth.cluster.launch import teardown
    from hearth.cluster.specs import DeployOptions
    from hearth.engine.checkpoint.dispatch import load_config
    from hearth.serving.server import free_port

    _, cfg = load_config(args.model)
    cluster = Cluster(initialize_head=True, head_node_args={
        "resources": {"desktop": 1}, "num_cpus": 2, "node_ip_address": "127.0.0.2", "include_dashboard": False})
    cluster.add_node(resources={"laptop": 1}, num_cpus=2, node_ip_address="127.0.0.2")
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    result: dict = {"model": str(args.model), "gen": args.gen, "runs": args.runs}
    try:
        result["hop_ms"] = hop_cost(cfg.hidden_size, 200) * 1e3
        engine = {"expert_device": "none", "static_decode": "off", "max_model_len": 512, "kv_cache_tokens": 2048}
        setups = (("one machine", {"replicas": 1, "require": "desktop"}), ("two stages", {"stages": True}))
        for label, options in setups:
            desc = deploy(DeployOptions(str(args.model), "m", port=free_port(), grpc_port=None, engine_options=engine,
                                        **options), log=lambda *_: None)
            try:
                decode_speed(desc["url"], 8)  # warm-up
                runs = [decode_speed(desc["url"], args.gen) for _ in range(args.runs)]
                together = [concurrent_speed(desc["url"], args.gen, args.concurrent) for _ in range(args.runs)] \
                    if args.concurrent else [0.0]
                result[label] = {"decode_tok_s": statistics.median(runs), "runs": runs,
                                 "concurrent_tok_s": statistics.median(together), "concurrent_runs": together,
                                 "stages": [(s["node_name"], s["first_layer"], s["end_layer"])
                                            for s in desc.get("stages", [])]}
            finally:
                teardown(log=lambda *_: None)
    finally:
        ray.shutdown()
        cluster.shutdown()
    report(args, cfg, result)
    emit(result, args.json)
    return 0


def report(args: argparse.Namespace, cfg, result: dict) -> None:
    """Print the two deployments' speeds as a table; adds their ratio to ``result``."""
    one, two = result["one machine"]["decode_tok_s"], result["two stages"]["decode_tok_s"]
    result["ratio"] = two / one
    print(f"\n{args.model} ({cfg.architecture}), {args.gen} tokens, median of {args.runs}; two Ray nodes on one "
          f"machine\n")
    print(f"stage hop (1-token batch + hidden [1, {cfg.hidden_size}] bf16, there and back): {result['hop_ms']:.2f} ms")
    c1, c2 = result["one machine"]["concurrent_tok_s"], result["two stages"]["concurrent_tok_s"]
    print(f"| deployment | decode tok/s (1 stream) | tok/s ({args.concurrent} streams) |\n|---|---:|---:|")
    print(f"| one machine | {one:.2f} | {c1:.2f} |")
    print(f"| two stages {result['two stages']['stages']} | {two:.2f} | {c2:.2f} |")
    print(f"| ratio | {result['ratio']:.2f}x | {c2 / c1 if c1 else 0:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
