"""The deployed system's costs: router overhead per request, executor restart vs cold start, idle CPU.

On a local one-node Ray cluster this deploys the model with ``cluster.deploy`` (pool, CPU-worker,
executor, monitor and router actors; the virtual expert device by default, so the actor set is
the one of a GPU machine) and, in this process, the same model behind an in-process engine
client and behind ``hearth serve``'s HTTP server. The three paths take turns, request by
request, so the overhead is a difference of medians measured side by side:

- engine: the in-process engine client, no HTTP;
- http:   ``hearth serve`` (HTTP + in-process engine);
- router: HTTP to the router actor, which calls the executor actor (Ray streaming generator).

Then the executor actor is killed ``--restarts`` times (Ray restarts it; it re-attaches to the
pool) and timed against the cold start, and finally the CPU time of every hearth actor process
is sampled while the deployment sits idle.

    python bench/cluster.py [--model DIR] [--requests 10] [--gen 16] [--idle-seconds 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from hearth.config import EngineConfig, ServingConfig  # noqa: E402
from hearth.engine.sampling import SamplingParams  # noqa: E402
from hearth.proto.contracts import GenerateRequest  # noqa: E402
from hearth.serving.server import BackgroundServer, build_state, free_port  # noqa: E402

PROMPT = "def fibonacci(n):\n    "


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def time_engine(client, ids: list[int], gen: int) -> float:
    async def one() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
        async for _ in client.generate(GenerateRequest(f"b-{time.perf_counter_ns()}", ids, params)):
            pass

    start = time.perf_counter()
    asyncio.run(one())
    return time.perf_counter() - start


def time_http(url: str, model: str, gen: int) -> float:
    start = time.perf_counter()
    r = requests.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": gen,
                                                      "temperature": 0, "ignore_eos": True}, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - start


def overhead(args, desc, local, ids) -> dict:
    times: dict[str, list[float]] = {"engine": [], "http": [], "router": []}
    for mode in times:  # warm-up: first requests build kernels, caches, connections
        _run(mode, args, desc, local, ids)
    for _ in range(args.requests):
        for mode in times:
            times[mode].append(_run(mode, args, desc, local, ids))
    med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
    return {"gen_tokens": args.gen, "requests": args.requests, "median_ms": med,
            "router_minus_engine_ms": med["router"] - med["engine"],
            "router_minus_http_ms": med["router"] - med["http"], "router_over_engine": med["router"] / med["engine"]}


def _run(mode: str, args, desc, local, ids) -> float:
    if mode == "engine":
        return time_engine(local.state.client, ids, args.gen)
    url = local.url if mode == "http" else desc["url"]
    return time_http(url, "bench", args.gen)


def wait_restarted(executor, old_pid: int, timeout_s: float = 600.0) -> dict:
    """The executor's ready() info once a process other than ``old_pid`` answers."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = ray.get(executor.ready.remote(), timeout=120)
            if info["pid"] != old_pid:
                return info
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            if isinstance(exc, ray.exceptions.ActorDiedError) and "creation task" in str(exc):
                raise  # its constructor failed: it will not come back
            time.sleep(0.05)
    raise TimeoutError("the executor did not come back")


def restarts(args, desc) -> dict:
    import ray

    replica = desc["replicas"][0]
    executor = ray.get_actor(replica["replica_actor_name"], namespace="hearth")
    pool = ray.get_actor(replica["replica_actor_name"].replace(":replica:", ":pool:"), namespace="hearth")
    pool_info, cold = ray.get(pool.info.remote()), ray.get(executor.ready.remote())
    restart_s, load_s = [], []
    info = cold
    for _ in range(args.restarts):
        pid = info["pid"]
        start = time.perf_counter()
        ray.kill(executor, no_restart=False)
        info = wait_restarted(executor, pid)
        restart_s.append(time.perf_counter() - start)
        load_s.append(info["load_seconds"])
        assert info["attached_pool"], "the restarted executor read the pool again"
    after = ray.get(pool.info.remote())
    # A cold replica, end to end: pool and executor processes both gone; Ray recreates them, the pool
    # reads the experts from FTW again and the executor builds its engine on it.
    start = time.perf_counter()
    ray.kill(pool, no_restart=False)
    ray.kill(executor, no_restart=False)
    info = wait_restarted(executor, info["pid"])
    cold_until_ready = time.perf_counter() - start
    # Cold: the pool actor reads the experts, then the executor builds the engine on it (dense weights,
    # KV cache, kernels). Restart: Ray starts a new executor process, which builds the engine on the
    # pool that is already filled.
    return {"pool_read_s": pool_info["load_seconds"], "cold_executor_load_s": cold["load_seconds"],
            "cold_start_s": pool_info["load_seconds"] + cold["load_seconds"],
            "restart_until_ready_s": statistics.median(restart_s), "restart_engine_load_s": statistics.median(load_s),
            "restarts": len(restart_s), "pool_loads": after["loads"], "cold_until_ready_s": cold_until_ready}


def idle_cpu(args, desc) -> dict:
    import ray

    replica = desc["replicas"][0]
    name = replica["replica_actor_name"]

    def actor(role: str):
        return ray.get_actor(name.replace(":replica:", f":{role}:"), namespace="hearth")

    pids = {"router": desc["pid"], "executor": ray.get(actor("replica").stats.remote())["pid"],
            "pool": ray.get(actor("pool").info.remote())["pid"],
            "monitor": ray.get(actor("monitor").status.remote())["pid"]}
    with contextlib.suppress(ValueError):  # no CPU-worker actor without an expert device
        pids["cpu_worker"] = ray.get(actor("cpu").ping.remote())
    # Ray's own cost per process: an actor that does nothing, measured in the same window.
    baseline = ray.remote(_Idle).options(num_cpus=0).remote()
    pids["ray_baseline"] = ray.get(baseline.pid.remote())
    time.sleep(5)  # let the last request's work settle
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    time.sleep(args.idle_seconds)
    used = {k: (cpu_seconds(p) - before[k]) / args.idle_seconds * 100 for k, p in pids.items()}
    base = used.pop("ray_baseline")
    total = sum(used.values())
    return {"seconds": args.idle_seconds, "percent_of_one_core": used, "total_percent": total,
            "ray_baseline_percent_per_process": base, "beyond_ray_percent": total - base * len(used)}


class _Idle:
    def pid(self) -> int:
        return os.getpid()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: a tiny random one)")
    p.add_argument("--requests", type=int, default=10, help="timed requests per path")
    p.add_argument("--gen", type=int, default=16, help="tokens per request")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--no-virtual-device", action="store_true", help="deploy a plain CPU executor instead")
    p.add_argument("--json", type=Path, default=Path(__file__).parent / "out" / "cluster.json")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hearth-bench-"))
    os.environ.setdefault("HEARTH_CACHE", str(tmp / "cache"))
    model = args.model
    if model is None:
        from tests.checkpoints import make_checkpoint

        model, _ = make_checkpoint(tmp / "tiny", "qwen3_moe", chat_format="agent")
    import ray

    from hearth.cluster.deploy import deploy
    from hearth.cluster.launch import teardown
    from hearth.cluster.specs import DeployOptions
    from hearth.engine.text.tokenizer import load_tokenizer

    engine_options = {} if args.no_virtual_device else {"expert_device": "virtual", "expert_cache": "0.25",
                                                         "cpu_experts": "external"}
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    serve_options = ServingConfig(port=free_port(), grpc_port=None, model_names=("bench",))
    # The local paths run the same engine setup as the replica: its CPU experts in a worker process
    # on a shared pool, where the replica has them in the CPU-worker actor.
    local_options = dict(engine_options, cpu_experts="process", host_pool_name=f"bench-local-{os.getpid()}") \
        if engine_options else {}
    local = BackgroundServer(build_state(model, EngineConfig(**local_options), serve_options), serve_options)
    try:
        local.start()
        desc = deploy(DeployOptions(str(model), "bench", port=free_port(), grpc_port=None,
                                    engine_options=engine_options), log=lambda m: print(m, file=sys.stderr))
        ids = load_tokenizer(model).encode(PROMPT, add_special_tokens=False)
        result = {"model": str(model), "machine": f"{os.cpu_count()} CPUs", "engine_options": engine_options,
                  "overhead": overhead(args, desc, local, ids), "restart": restarts(args, desc),
                  "idle": idle_cpu(args, desc)}
    finally:
        local.stop()
        teardown(log=lambda m: None)
        ray.shutdown()
    report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    emit(result, args.json)
    return 0


def report(result: dict) -> None:
    """Print the router overhead, the restart times and the idle CPU use."""
    o, r, i = result["overhead"], result["restart"], result["idle"]
    med = o["median_ms"]
    print(f"\nrequest of {o['gen_tokens']} tokens, median of {o['requests']} (ms): engine {med['engine']:.1f}  "
          f"hearth serve {o['median_ms']['http']:.1f}  router {o['median_ms']['router']:.1f}  "
          f"-> router overhead {o['router_minus_engine_ms']:.1f} ms vs engine, {o['router_minus_http_ms']:.1f} ms vs "
          f"hearth serve")
    print(f"cold start {r['cold_start_s']:.2f} s (pool read {r['pool_read_s']:.2f} s + executor "
          f"{r['cold_executor_load_s']:.2f} s); executor restart {r['restart_until_ready_s']:.2f} s until ready "
          f"(engine load {r['restart_engine_load_s']:.2f} s), pool loads {r['pool_loads']}; pool and executor "
          f"both restarted: {r['cold_until_ready_s']:.2f} s until ready")
    print(f"idle CPU over {i['seconds']:.0f} s: {i['total_percent']:.2f} % of one core in hearth's "
          f"{len(i['percent_of_one_core'])} actor processes ("
          + ", ".join(f"{k} {v:.2f}%" for k, v in i["percent_of_one_core"].items())
          + f"); an idle Ray actor costs {i['ray_baseline_percent_per_process']:.2f}%: beyond Ray's own "
          f"{i['beyond_ray_percent']:.2f}%")


if __name__ == "__main__":
    raise SystemExit(main())
