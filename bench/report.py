"""Generate ``docs/benchmarks.md`` from the whole suite in one command.

    python -m bench.report                       # everything (about 15 minutes on 2 cores)
    python -m bench.report --skip-bench          # traces, replay and simulator only

Steps: record the demo model's traces (held-out code, chat, its random twin) unless they exist;
draw synthetic traces of low and high locality in the demo's shape and in a real model's shape
(48 layers, 128 experts, top-8); routing statistics; cache-policy replay at 11 % and 37 %; the
step-time simulator on the six reference machines of docs/design.md plus this one (tables and a PNG); and
``hearth bench`` of the demo model and of a ~1B random model against transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import cache_replay, simulate, traces  # noqa: E402
from bench.common import machine_facts  # noqa: E402
from bench.decode import RANDOM_1B  # noqa: E402

SYNTHETIC = {"low": 0.2, "high": 0.8}


def machine_line() -> str:
    """CPU model, cores, RAM, OS, Python and torch versions of this machine."""
    import torch

    cpu = machine_facts()["cpu"]
    if cpu == "unknown":
        cpu = platform.processor() or platform.machine()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {ram:.0f} GiB RAM, {gpu}; {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__}")


def trace_set(demo: Path, out: Path, fresh: bool, random_1b: Path) -> dict[str, list[traces.Trace]]:
    """Recorded and synthetic traces, by role (``random_1b``: also a short trace of that model)."""
    name = demo.name
    recorded = [out / f"{name}-{kind}.jsonl.gz" for kind in ("heldout", "chat", "random-heldout")]
    if fresh or not all(p.is_file() for p in recorded):
        print("recording traces …", file=sys.stderr, flush=True)
        recorded = traces.record_standard(demo, out)
    demo_traces = [traces.load(p) for p in recorded]
    shape = demo_traces[0]
    small = [traces.synthetic(shape.num_layers, shape.num_experts, shape.top_k, 2048, loc, seed=1,
                              name=f"synthetic {label} locality (demo shape)") for label, loc in SYNTHETIC.items()]
    real = [traces.synthetic(48, 128, 8, 1200, loc, seed=1, name=f"synthetic {label} locality (48×128, top-8)")
            for label, loc in SYNTHETIC.items()]
    big = out / "random-1b-heldout.jsonl.gz"
    if (fresh or not big.is_file()) and (random_1b / "config.json").is_file():
        traces.save(traces.record_held_out(random_1b, "random-1b-heldout", segments=4), big)
    reference = [traces.load(big)] if big.is_file() else []
    return {"recorded": demo_traces, "small": small, "real": real, "reference": reference}


def run_bench(model: Path, label: str, extra: list[str], out: Path) -> dict:
    """``hearth bench`` in a fresh process (its own memory), with JSON output."""
    cmd = [sys.executable, "-m", "hearth.cli.main", "bench", "--model", str(model), "--transformers",
           "--json", str(out), *extra]
    print(f"bench {label}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def demo_sample(demo: Path) -> tuple[str, str]:
    """The demo model's greedy continuation of a Python prompt."""
    from hearth.engine import LLM, SamplingParams

    prompt = "def read_lines(path):\n    with open(path) as f:"
    with LLM(demo) as llm:
        text = llm.generate(prompt, SamplingParams(max_tokens=120, temperature=0))[0].text
    return prompt, text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="the demo model (default: the bundled one)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--data", type=Path, default=ROOT / "bench" / "out", help="traces and JSON results")
    p.add_argument("--fresh-traces", action="store_true", help="re-record the demo traces")
    p.add_argument("--skip-bench", action="store_true", help="leave out hearth bench (keeps the old section)")
    p.add_argument("--random-1b", type=Path, default=Path("/tmp/qwen3-1b"),
                   help="where the ~1B random model is (built there if absent)")
    args = p.parse_args(argv)
    from hearth.engine.checkpoint.demo import demo_model_dir

    demo = args.model or demo_model_dir()
    started = time.time()
    if not args.skip_bench and not (args.random_1b / "config.json").is_file():
        from tests.checkpoints import make_checkpoint

        make_checkpoint(args.random_1b, "qwen3_moe", "per_expert", "bfloat16", shard_bytes=1 << 30,
                        vocab_size=32000, **RANDOM_1B["qwen3_moe"])
    sets = trace_set(demo, args.data / "traces", args.fresh_traces, args.random_1b)
    uniform = traces.uniform(sets["recorded"][0].num_layers, sets["recorded"][0].num_experts,
                             sets["recorded"][0].top_k, 2048)
    stats = [traces.summary(t) for t in sets["recorded"] + [uniform] + sets["reference"] + sets["small"] + sets["real"]]
    print("cache replay …", file=sys.stderr, flush=True)
    replay_rows = [r for t in sets["recorded"] + sets["small"] + sets["real"]
                   for r in cache_replay.replay(t, [0.11, 0.37])]
    print("simulator …", file=sys.stderr, flush=True)
    machines = list(simulate.DESIGN_MACHINES) + [simulate.this_machine()]
    sim_rows = [r for t in sets["real"] + sets["recorded"][:1] for cap in (0.11, 0.37)
                for r in simulate.simulate(t, machines, cap)]
    img = args.out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    for t in sets["real"]:
        key = [r for r in sim_rows if r["trace"] == t.name and r["capacity"] == 0.37]
        simulate.plot(key, img / f"simulate_{t.name.split()[1]}_locality.png", f"{t.name}, cache 37 %")
    bench: dict[str, dict] = {}
    if not args.skip_bench:
        bench["demo"] = run_bench(demo, "demo", ["-r", "5", "--cache-fraction", "0.11", "0.37"],
                                  args.data / "bench_demo.json")
        bench["random-1b"] = run_bench(args.random_1b, "random 1B", ["-r", "3", "-n", "64"],
                                       args.data / "bench_random_1b.json")
    else:
        for key, name in (("demo", "bench_demo.json"), ("random-1b", "bench_random_1b.json")):
            if (args.data / name).is_file():
                bench[key] = json.loads((args.data / name).read_text())
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine_line(), "stats": stats,
               "replay": replay_rows, "simulate": sim_rows, "bench": bench}
    (args.data / "benchmarks.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    from bench.report_page import render

    args.out.write_text(render(results, demo, demo_sample(demo), time.time() - started))
    print(f"wrote {args.out} in {(time.time() - started) / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
