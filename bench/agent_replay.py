"""Agent workload replay: how many prompt tokens each prefix-cache strategy recomputes per turn.

Scripted multi-turn agent sessions (a system prompt with tools, then turns of thinking, a tool call
and its result) are rendered with the checkpoint's chat template the way three kinds of client
resend their history each turn:

- ``openclaw``: every thinking block but the newest is dropped;
- ``opencode``: every tool result but the newest ``--keep-results`` (default 1) is replaced by a
  short placeholder;
- ``append``: plain append-only chat, nothing edited.

Each turn's prompt goes to one engine per strategy, in turn order, on a hybrid model:

- ``none``: no prefix cache: every prompt token is computed;
- ``kv``: the prefix tree with a recurrent-state copy only where each prompt ends (what a plain
  prefix cache keeps for a hybrid model);
- ``periodic``: state checkpoints every ``--interval`` tokens;
- ``anchors``: checkpoints at semantic anchors plus the periodic ones.

Every strategy gets the same checkpoint budget (``--budget`` checkpoints' worth of bytes). It
reports recomputed prompt tokens per turn and in total, and TTFT per turn (median and worst).

    python bench/agent_replay.py --model /tmp/hybrid-agent --build-random
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from hearth.engine import SamplingParams  # noqa: E402
from hearth.engine.cache.state_slots import RecurrentStatePool  # noqa: E402
from hearth.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from hearth.engine.text.tokenizer import render_chat  # noqa: E402

STYLES = ("openclaw", "opencode", "append")
STRATEGIES = ("none", "kv", "periodic", "anchors")
PLACEHOLDER = "[Old tool result content cleared]"
TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc,
                                      "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}}}
    for name, desc in (("read_file", "Read a file of the project"), ("run", "Run a shell command"),
                       ("search", "Search the code for a pattern"))
]
_WORDS = (
    "def", "return", "self", "value", "list", "dict", "key", "path", "file", "open", "read", "write", "line",
    "split", "strip", "count", "index", "error", "raise", "check", "test", "result", "data", "item", "name",
    "config", "cache", "layer", "expert", "token", "state", "block", "the", "a", "of", "to", "and", "is", "in",
    "for", "with", "this", "that", "should", "then", "next", "call", "look", "find", "fix", "update",
)


def _text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(_WORDS))
        if len(line) >= rng.randrange(6, 12):
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)]).strip()


def build_session(seed: int, turns: int, result_words: tuple[int, int] = (60, 220)) -> list[dict[str, Any]]:
    """The full history of one scripted session: system, user task, then per turn an assistant
    message (thinking + one tool call) and the tool's result, and a final answer."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. " + _text(rng, 30)},
        {"role": "user", "content": "Task: " + _text(rng, 40)},
    ]
    for _ in range(turns):
        tool = rng.choice(TOOLS)["function"]["name"]
        messages.append({"role": "assistant", "content": "", "reasoning_content": _text(rng, rng.randrange(30, 90)),
                         "tool_calls": [{"function": {"name": tool, "arguments": {"arg": _text(rng, 6)}}}]})
        messages.append({"role": "tool", "content": _text(rng, rng.randrange(*result_words))})
    messages.append({"role": "assistant", "content": "Done. " + _text(rng, 20),
                     "reasoning_content": _text(rng, 40)})
    return messages


def client_view(history: list[dict[str, Any]], style: str, keep_results: int = 1) -> list[dict[str, Any]]:
    """The history as a client of ``style`` resends it."""
    view = [dict(m) for m in history]
    if style == "openclaw":
        thinking = [i for i, m in enumerate(view) if m.get("reasoning_content")]
        for i in thinking[:-1]:
            view[i].pop("reasoning_content")
    elif style == "opencode":
        tools = [i for i, m in enumerate(view) if m["role"] == "tool"]
        for i in tools[: len(tools) - keep_results]:
            view[i]["content"] = PLACEHOLDER
    elif style != "append":
        raise ValueError(f"unknown client style '{style}' (one of {', '.join(STYLES)})")
    return view


def turn_prompts(tokenizer: Any, history: list[dict[str, Any]], style: str, keep_results: int = 1) -> list[list[int]]:
    """One prompt per turn: the history up to each tool result, as the client renders it."""
    ends = [i + 1 for i, m in enumerate(history) if m["role"] == "tool"]
    return [tokenizer.encode(render_chat(tokenizer, client_view(history[:end], style, keep_results), TOOLS),
                             add_special_tokens=False) for end in ends]


def strategy_config(strategy: str, budget_bytes: int, interval: int) -> EngineConfig:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy '{strategy}' (one of {', '.join(STRATEGIES)})")
    policy = {"none": "none", "kv": "prompt-end", "periodic": "periodic", "anchors": "anchors"}[strategy]
    return EngineConfig(prefix_caching=strategy != "none", checkpoints=policy, checkpoint_interval=interval,
                        checkpoint_bytes=budget_bytes, expert_device="none", max_num_seqs=4)


def replay(engine: LLMEngine, prompts: list[list[int]]) -> list[dict[str, float]]:
    """Send each prompt in order (one token generated); recomputed tokens and TTFT per turn."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = []
    for prompt in prompts:
        start = time.perf_counter()
        rid = engine.add_request(prompt, params)
        metrics = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    metrics = out.metrics
        rows.append({"prompt": len(prompt), "recomputed": len(prompt) - metrics.num_cached_tokens,
                     "ttft": metrics.first_token - metrics.arrival, "wall": time.perf_counter() - start})
    return rows


def simulate(prompts: list[list[int]], strategy: str, budget: int, interval: int, anchors: frozenset[int],
             block_size: int = 16) -> list[int]:
    """Recomputed prompt tokens per turn, from the engine's own scheduler, prefix tree and
    checkpoint store with the model left out (each checkpoint counts as one unit of the budget):
    a quick sweep of budgets and intervals. ``replay`` gives the same counts with the model."""
    import torch

    from hearth.engine.cache.kv_pages import BlockAllocator
    from hearth.engine.cache.prefix_tree import RadixCache
    from hearth.engine.cache.state_checkpoints import CheckpointStore, checkpoint_positions
    from hearth.engine.cache.state_slots import StateSnapshot
    from hearth.engine.request import Request
    from hearth.engine.scheduler import RecurrentConfig, Scheduler, SchedulerConfig

    config = strategy_config(strategy, budget * 4, interval)
    unit = StateSnapshot({0: (torch.zeros(0), torch.zeros(1))})  # 4 bytes
    longest = max(len(p) for p in prompts)
    blocks = 4 * (longest // block_size + 2)
    prefix = RadixCache(block_size) if config.kv_cache.prefix_caching else None
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512, prefill_chunk=512),
                      BlockAllocator(blocks, block_size), prefix,
                      RecurrentConfig(1, CheckpointStore(config.checkpoints.budget_bytes)))
    recomputed = []
    for turn, prompt in enumerate(prompts):
        req = Request(str(turn), list(prompt), SamplingParams(max_tokens=1))
        sched.add(req)
        while req.num_computed < len(prompt):
            for r, n in sched.schedule().items:
                plan = checkpoint_positions(r.tokens, r.num_computed, r.num_computed + n, len(r.prompt_ids),
                                            block_size, config.checkpoints.policy, interval, anchors)
                plan = sched.checkpoints.worth_taking(plan, unit.nbytes) if sched.checkpoints is not None else {}
                r.num_computed += n
                sched.cache_computed(r)
                for position, kinds in plan.items():
                    sched.add_checkpoint(r, position, unit, kinds)
        recomputed.append(len(prompt) - req.num_cached_tokens)
        sched.finish(req, "length")
    return recomputed


def summarize(rows: list[dict[str, float]]) -> dict[str, float]:
    ttft = [r["ttft"] for r in rows]
    return {"recomputed": sum(r["recomputed"] for r in rows), "prompt_tokens": sum(r["prompt"] for r in rows),
            "ttft_median": statistics.median(ttft), "ttft_worst": max(ttft)}


def run(model: Path, styles: list[str], strategies: list[str], sessions: int, turns: int, budget: int,
        interval: int, keep_results: int) -> dict[str, Any]:
    probe = LLMEngine(model, EngineConfig(expert_device="none", max_num_seqs=1))
    tokenizer, per_checkpoint = probe.tokenizer, RecurrentStatePool.bytes_per_sequence(probe.model_config)
    probe.close()
    if per_checkpoint == 0:
        raise SystemExit(f"{model} is not a hybrid model: it has no recurrent state to checkpoint")
    results: dict[str, Any] = {}
    for style in styles:
        prompts = [turn_prompts(tokenizer, build_session(seed, turns), style, keep_results) for seed in range(sessions)]
        for strategy in strategies:
            engine = LLMEngine(model, strategy_config(strategy, budget * per_checkpoint, interval))
            rows = [row for session in prompts for row in replay(engine, session)]
            stats = engine.stats()
            engine.close()
            results[f"{style}/{strategy}"] = {"turns": rows, **summarize(rows),
                                              "checkpoints": stats.get("checkpoints", 0),
                                              "checkpoint_evictions": stats.get("checkpoint_evictions", 0)}
            s = results[f"{style}/{strategy}"]
            print(f"{style:9s} {strategy:9s} recomputed {s['recomputed']:6d} of {s['prompt_tokens']:6d}  "
                  f"ttft median {s['ttft_median'] * 1e3:7.1f} ms  worst {s['ttft_worst'] * 1e3:7.1f} ms",
                  file=sys.stderr, flush=True)
    return results


def sweep(model: Path, styles: list[str], sessions: int, turns: int, budgets: list[int], interval: int,
          keep_results: int) -> dict[str, Any]:
    """Recomputed tokens of periodic-only and anchors + periodic across checkpoint budgets (0:
    unlimited), without the model (:func:`simulate`)."""
    engine = LLMEngine(model, EngineConfig(expert_device="none", max_num_seqs=1))
    tokenizer, anchors = engine.tokenizer, engine.anchor_ids
    engine.close()
    table: dict[str, Any] = {}
    for style in styles:
        prompts = [p for seed in range(sessions)
                   for p in turn_prompts(tokenizer, build_session(seed, turns), style, keep_results)]
        for budget in budgets:
            row = {s: sum(simulate(prompts, s, budget or 10**9, interval, anchors)) for s in ("periodic", "anchors")}
            table[f"{style}/{budget}"] = {**row, "prompt_tokens": sum(map(len, prompts)),
                                          "ratio": row["periodic"] / row["anchors"]}
    return table


def sweep_markdown(table: dict[str, Any], styles: list[str], budgets: list[int]) -> str:
    head = " | ".join(str(b) if b else "unlimited" for b in budgets)
    lines = [f"| client \\ budget (checkpoints) | {head} |", "|---|" + "---:|" * len(budgets)]
    for style in styles:
        cells = [f"{table[f'{style}/{b}']['periodic']} / {table[f'{style}/{b}']['anchors']} = "
                 f"**{table[f'{style}/{b}']['ratio']:.2f}×**" for b in budgets]
        lines.append(f"| {style} (periodic / anchors) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: dict[str, Any], styles: list[str], strategies: list[str]) -> str:
    lines = ["| client | strategy | recomputed tokens | of prompt tokens | ÷ anchors | TTFT median | TTFT worst |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for style in styles:
        base = results.get(f"{style}/anchors", {}).get("recomputed")
        for strategy in strategies:
            r = results[f"{style}/{strategy}"]
            ratio = f"{r['recomputed'] / base:.2f}×" if base else "–"
            lines.append(f"| {style} | {strategy} | {r['recomputed']} | {r['prompt_tokens']} | {ratio} | "
                         f"{r['ttft_median'] * 1e3:.0f} ms | {r['ttft_worst'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def build_model(path: Path) -> None:
    """A small random Qwen3.5-MoE hybrid (6 DeltaNet + 2 attention layers) with the agent template."""
    from tests.checkpoints import make_checkpoint

    make_checkpoint(path, "qwen3_5_moe", chat_format="agent", hidden_size=256, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16,
                    num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=256,
                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32,
                    linear_value_head_dim=32, max_position_embeddings=32768)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/hybrid-agent"))
    p.add_argument("--build-random", action="store_true", help="build the small random hybrid at --model if absent")
    p.add_argument("--styles", nargs="+", default=list(STYLES), choices=STYLES)
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--budget", type=int, default=4, help="checkpoint budget, in checkpoints' worth of bytes")
    p.add_argument("--interval", type=int, default=64)
    p.add_argument("--keep-results", type=int, default=1, help="opencode: tool results kept whole (newest)")
    p.add_argument("--sweep", type=int, nargs="+", metavar="BUDGET",
                   help="instead: recomputed tokens across these budgets (0 = unlimited), without the model")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.build_random and not (args.model / "config.json").is_file():
        build_model(args.model)
    meta = {"model": str(args.model), "interval": args.interval, "sessions": args.sessions, "turns": args.turns,
            "keep_results": args.keep_results}
    if args.sweep:
        table = sweep(args.model, args.styles, args.sessions, args.turns, args.sweep, args.interval,
                      args.keep_results)
        print(sweep_markdown(table, args.styles, args.sweep))
        emit({**meta, "sweep": table}, args.json)
        return 0
    results = run(args.model, args.styles, args.strategies, args.sessions, args.turns, args.budget, args.interval,
                  args.keep_results)
    print(markdown(results, args.styles, args.strategies))
    emit({**meta, "budget_checkpoints": args.budget, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
