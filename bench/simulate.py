"""Step-time model: expected decode speed of a trace on a machine under each miss-split policy.

For every decode MoE layer call of a trace, a global LRU expert cache (``capacity`` of all
experts) classifies the call's experts into hits and m misses; the split policy chooses q of them
to fill over the link, the rest run on the CPU. The call's exposed time is the design's model
(docs/design.md, the q* cost model): ``max(q·S / B_P, (m − q)·S / B_R)`` with ``B_R = max(B_H − B_P, 0)`` plus each
path's fixed cost; a call that fills nothing leaves the link idle, so its CPU share gets all of
B_H. Hits run on the GPU and are taken as free. Filled experts enter the cache, CPU experts do
not, so the policies also shape later hit rates. Policies:

- ``fill-only``: q = m (every miss crosses the link);
- ``cpu-only``: no expert cache at all; every routed expert runs on the CPU at the full B_H;
- ``naive-q*``: q = round(m · B_P / B_H), the closed form rounded;
- ``step-q*``: the per-step optimal table of ``hearth.engine.experts.policy.qstar`` (fill credit 0);
- ``tuned-q*``: what the engine runs: that table with its fill credit picked online by
  ``hearth.engine.experts.policy.tuning.CreditTuner``, fed the simulated call times.

Tokens/s counts expert time only (attention and dense layers excluded), so it is an upper bound
whose ratios between policies are the result.

    python -m bench.simulate bench/out/traces/*.jsonl.gz --capacity 0.37 --plot sim.png
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from bench.cache_replay import Call, GlobalLRU, layer_calls
from bench.traces import Trace, load
from hearth.engine.experts.policy.qstar import PathCost, SplitCosts, best_q, step_seconds
from hearth.engine.experts.policy.tuning import TUNER_EPOCH_TOKENS, CreditTuner

GB = 1e9
# Qwen3-30B-A3B / Qwen3.6-35B-A3B experts: 3 matrices of 2048 x 768 in bf16.
REAL_EXPERT_BYTES = 3 * 2048 * 768 * 2


@dataclass(frozen=True)
class Machine:
    """Bandwidths in bytes/s; ``b_p`` None for a machine without a GPU."""

    name: str
    b_p: float | None
    b_h: float
    link_fixed_s: float = 0.0
    cpu_fixed_s: float = 0.0


# The paper's Table 1 (docs/design.md, the q* cost model): pinned host->device copy and CPU-expert bandwidths.
DESIGN_MACHINES = (
    Machine("RTX 4060 laptop", 11.8 * GB, 47.5 * GB),
    Machine("RTX 4090", 25.1 * GB, 63.2 * GB),
    Machine("RTX 3090", 25.3 * GB, 56.7 * GB),
    Machine("RTX PRO 6000", 51.5 * GB, 178.0 * GB),
    Machine("RTX 5090 server", 52.7 * GB, 77.3 * GB),
    Machine("RTX 5090 desktop", 49.0 * GB, 53.8 * GB),
)

POLICIES = ("fill-only", "cpu-only", "naive-q*", "step-q*", "tuned-q*")


def costs_of(machine: Machine, expert_bytes: int) -> SplitCosts:
    link = PathCost(machine.b_p, machine.link_fixed_s) if machine.b_p else None
    return SplitCosts(expert_bytes, link, machine.b_h, machine.cpu_fixed_s)


def choose_q(policy: str, machine: Machine, costs: SplitCosts, m: int, credit: float = 0.0) -> int:
    """How many of m misses the policy fills (``credit``: the tuned policy's current fill credit)."""
    if machine.b_p is None:
        return 0
    if policy == "fill-only":
        return m
    if policy == "naive-q*":
        return min(m, math.floor(m * machine.b_p / machine.b_h + 0.5))
    if policy == "step-q*":
        return best_q(costs, m)
    if policy == "tuned-q*":
        return best_q(costs, m, credit)
    raise ValueError(f"unknown split policy '{policy}'")


def call_seconds(machine: Machine, costs: SplitCosts, m: int, q: int) -> float:
    """Exposed time of one call: the design's split model, with the CPU at all of B_H when the
    link is idle (q = 0)."""
    if q == 0 and m:
        return PathCost(machine.b_h, machine.cpu_fixed_s).seconds(m * costs.expert_bytes)
    return step_seconds(costs, m, q)


def decode_seconds(calls: list[Call], machine: Machine, policy: str, capacity: int, expert_bytes: int) -> float:
    """Total exposed expert time of the trace's decode calls (prefill calls warm the cache)."""
    costs = costs_of(machine, expert_bytes)
    if policy == "cpu-only" or machine.b_p is None:
        cpu = PathCost(machine.b_h, machine.cpu_fixed_s)
        return sum(cpu.seconds(len(c.ids) * expert_bytes) for c in calls if c.decode)
    layers = len({c.layer for c in calls}) or 1
    tuner = CreditTuner(epoch_calls=TUNER_EPOCH_TOKENS * layers) if policy == "tuned-q*" else None
    cache = GlobalLRU(capacity, None, calls)
    total = 0.0
    for call in calls:
        misses = cache.lookup(call)
        if call.decode:
            q = choose_q(policy, machine, costs, len(misses), tuner.credit if tuner else 0.0)
            seconds = call_seconds(machine, costs, len(misses), q)
            total += seconds
            if tuner is not None:
                tuner.observe(seconds)
        else:
            q = len(misses)  # prefill streams whole layers in; every miss is loaded
        cache.admit(misses[:q], call)  # CPU-computed experts do not enter the cache
    return total


def simulate(trace: Trace, machines: list[Machine], capacity: float,
             expert_bytes: int = REAL_EXPERT_BYTES) -> list[dict]:
    """tokens/s (expert time only) of every policy on every machine for one trace and capacity."""
    calls = layer_calls(trace)
    slots = max(1, round(capacity * trace.num_layers * trace.num_experts))
    tokens = max(int(trace.decode.sum()), 1)
    rows = []
    for machine in machines:
        for policy in POLICIES:
            if machine.b_p is None and policy != "cpu-only":
                continue
            seconds = decode_seconds(calls, machine, policy, slots, expert_bytes)
            rows.append({"trace": trace.name, "machine": machine.name, "capacity": capacity, "policy": policy,
                         "tok_s": round(tokens / seconds, 2) if seconds else math.inf})
    return rows


def this_machine(expert_bytes: int = REAL_EXPERT_BYTES) -> Machine:
    """This computer, measured: B_H with the real CPU expert kernel on real-shaped bf16 experts
    (no GPU here, so no link)."""
    import torch

    from hearth.engine.experts.measure import measure_host_path
    from hearth.engine.experts.pool import ExpertPool
    from hearth.engine.ops import activation

    hidden, inter = 2048, 768
    n = max(16, (512 << 20) // expert_bytes)  # larger than the last-level cache
    gate_up = torch.randn(n, 2 * inter, hidden, dtype=torch.bfloat16) * 0.02
    down = torch.randn(n, hidden, inter, dtype=torch.bfloat16) * 0.02
    # One MoE layer of n experts: the fields ExpertPool reads from a model config.
    shape = SimpleNamespace(num_experts=n, moe_layer_ids=[0], num_layers=1, moe_intermediate_size=inter,
                            hidden_size=hidden, dtype=torch.bfloat16)
    pool = ExpertPool(shape, (gate_up, down))
    cost = measure_host_path(pool, activation("silu"), k=8)
    return Machine("this machine (CPU only)", None, cost.bytes_per_s, cpu_fixed_s=cost.fixed_s)


def markdown(rows: list[dict]) -> str:
    """Per trace and capacity: machines as rows, policies as columns (tok/s), and both tables'
    speed relative to the better single path."""
    out = []
    for key in dict.fromkeys((r["trace"], r["capacity"]) for r in rows):
        sub = [r for r in rows if (r["trace"], r["capacity"]) == key]
        out += [f"**{key[0]}, cache {key[1]:.0%} of all experts** (decode tok/s, expert time only)", "",
                "| machine | " + " | ".join(POLICIES) + " | step vs best single path | tuned vs best single path |",
                "|---" * (len(POLICIES) + 3) + "|"]
        for machine in dict.fromkeys(r["machine"] for r in sub):
            cell = {r["policy"]: r["tok_s"] for r in sub if r["machine"] == machine}
            single = max(cell.get("fill-only", 0), cell.get("cpu-only", 0))
            gains = [f"{cell[p] / single:.3f}×" if p in cell and single else "–" for p in ("step-q*", "tuned-q*")]
            out.append(f"| {machine} | " + " | ".join(f"{cell[p]:.1f}" if p in cell else "–" for p in POLICIES)
                       + " | " + " | ".join(gains) + " |")
        out.append("")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Grouped bars: tokens/s per machine (one group) and policy (one bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    machines = list(dict.fromkeys(r["machine"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        values = [next((r["tok_s"] for r in rows if r["machine"] == m and r["policy"] == policy), 0.0)
                  for m in machines]
        ax.bar([x + i * width for x in range(len(machines))], values, width, label=policy)
    ax.set_xticks([x + width * (len(POLICIES) - 1) / 2 for x in range(len(machines))])
    ax.set_xticklabels(machines, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("decode tok/s (expert time only)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--capacity", type=float, nargs="+", default=[0.37])
    p.add_argument("--expert-bytes", type=int, default=REAL_EXPERT_BYTES)
    p.add_argument("--no-measure", action="store_true", help="leave this machine out (no B_H measurement)")
    p.add_argument("--plot", type=Path, help="PNG of the first trace and capacity")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    machines = list(DESIGN_MACHINES) + ([] if args.no_measure else [this_machine(args.expert_bytes)])
    rows = [r for path in args.traces for cap in args.capacity
            for r in simulate(load(path), machines, cap, args.expert_bytes)]
    print(markdown(rows))
    if args.plot:
        first = (rows[0]["trace"], rows[0]["capacity"])
        plot([r for r in rows if (r["trace"], r["capacity"]) == first], args.plot,
             f"{first[0]}, cache {first[1]:.0%}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
