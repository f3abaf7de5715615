"""What constrained decoding costs per token: the grammar mask alone, and decode with and without it.

For a JSON schema and a forced tool call, on one checkpoint's tokenizer, it reports

- ``mask_ms``: median milliseconds to compute the grammar's next-token mask and apply it to one
  row of logits, then advance the matcher (the work the engine adds per constrained token);
- ``free`` / ``constrained`` decode tok/s of the engine on the same prompt, alternating run by
  run, ``--runs`` times, and their ratio.

    python bench/structured.py [--model DIR] [--tokens 64] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from hearth.engine import LLM, SamplingParams  # noqa: E402
from hearth.engine.checkpoint.demo import demo_model_dir  # noqa: E402
from hearth.serving.constraints import GrammarBuilder  # noqa: E402

SCHEMA = {"type": "object", "required": ["name", "tags", "size"], "additionalProperties": False, "properties": {
    "name": {"type": "string", "maxLength": 24}, "size": {"enum": ["s", "m", "l"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}}}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "required": ["path"], "properties": {"path": {"type": "string", "maxLength": 40},
                                                           "limit": {"type": "integer"}}}}}]


def mask_ms(llm: LLM, grammar: str, tokens: list[int]) -> float:
    """Median ms per token of mask + advance, replaying ``tokens`` (a reply the grammar accepts)."""
    matcher = llm.engine.grammars.matcher(grammar)
    logits = torch.randn(llm.engine.model_config.vocab_size)
    times = []
    for token in tokens:
        start = time.perf_counter()
        matcher.mask(logits)
        done = matcher.advance(token)
        times.append((time.perf_counter() - start) * 1e3)
        if done:
            break
    return statistics.median(times)


def decode_tok_s(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, list[int]]:
    out = llm.generate(prompt, params)[0]
    m = out.metrics
    n = max(m.num_output_tokens - 1, 1)
    return n / max(m.finished - m.first_token, 1e-9), list(out.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint (default: the bundled demo)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    llm = LLM(args.model or demo_model_dir(), max_num_seqs=1)
    builder = GrammarBuilder(llm.engine.tokenizer)
    cases = {"json_schema": ("Describe a thing as JSON: ", builder.json(SCHEMA)),
             "tool_call": ("Call a tool.\n<tool_call>\n", builder.tool_call("hermes", TOOLS, None))}
    rows = []
    for name, (prompt, grammar) in cases.items():
        free, constrained, replies = [], [], []
        for run in range(args.runs):  # alternate, so drift on the machine hits both alike
            base = dict(max_tokens=args.tokens, temperature=1.0, seed=run)
            free.append(decode_tok_s(llm, prompt, SamplingParams(ignore_eos=True, **base))[0])
            rate, reply = decode_tok_s(llm, prompt, SamplingParams(grammar=grammar, **base))
            constrained.append(rate)
            replies.append(reply)
        longest = max(replies, key=len)
        rows.append({"case": name, "mask_ms": round(mask_ms(llm, grammar, longest), 4),
                     "reply_tokens": len(longest), "free_tok_s": round(statistics.median(free), 1),
                     "constrained_tok_s": round(statistics.median(constrained), 1),
                     "ratio": round(statistics.median(constrained) / statistics.median(free), 3)})
    print(f"{'case':<12} {'mask ms':>8} {'tokens':>7} {'free tok/s':>11} {'constr tok/s':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['case']:<12} {r['mask_ms']:>8} {r['reply_tokens']:>7} {r['free_tok_s']:>11} "
              f"{r['constrained_tok_s']:>13} {r['ratio']:>6}")
    emit({"bench": "structured", "model": str(args.model or "demo"), "runs": args.runs, "rows": rows}, args.json)


if __name__ == "__main__":
    main()
