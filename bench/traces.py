"""Routing traces: which experts every token used, in order (format: ``docs/benchmarks.md``).

A trace is recorded from a real model (held-out text, multi-turn chat) or drawn from a synthetic
generator with tunable locality, and replayed by ``bench/cache_replay.py`` and
``bench/simulate.py``. Also here: the two statistics that say whether routing is realistic —
per-layer usage entropy and the probability that an expert used at token t is used again at t+1.

    python -m bench.traces record --out bench/out/traces      # demo model + random twin
    python -m bench.traces stats bench/out/traces/*.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import math
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "hearth-routing-trace"
VERSION = 1


@dataclass
class Trace:
    """Routing of ``N`` tokens: ``experts[n, layer]`` are token n's top-k expert ids (local to the
    layer, in router order); ``decode[n]`` says whether it was generated (else part of a prompt);
    ``segment[n]`` numbers the requests (a chat turn is one segment)."""

    name: str
    num_experts: int
    experts: np.ndarray  # [N, L, k] int16
    decode: np.ndarray  # [N] bool
    segment: np.ndarray  # [N] int32

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    def __len__(self) -> int:
        return int(self.experts.shape[0])


def save(trace: Trace, path: Path) -> None:
    """JSON lines (gzip when the name ends in .gz): a header, then one line per token."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write(json.dumps({"format": FORMAT, "version": VERSION, "name": trace.name,
                            "num_layers": trace.num_layers, "num_experts": trace.num_experts,
                            "top_k": trace.top_k, "tokens": len(trace)}) + "\n")
        for n in range(len(trace)):
            f.write(json.dumps({"segment": int(trace.segment[n]),
                                "phase": "decode" if trace.decode[n] else "prefill",
                                "experts": trace.experts[n].tolist()}, separators=(",", ":")) + "\n")


def load(path: Path) -> Trace:
    """Read a trace written by :func:`save`; a clear error for anything else."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        header = json.loads(f.readline())
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file")
        rows = [json.loads(line) for line in f if line.strip()]
    shape = (len(rows), header["num_layers"], header["top_k"])
    experts = np.array([r["experts"] for r in rows], dtype=np.int16).reshape(shape)
    return Trace(header["name"], header["num_experts"], experts,
                 np.array([r["phase"] == "decode" for r in rows], dtype=bool),
                 np.array([r["segment"] for r in rows], dtype=np.int32))


# ---------------------------------------------------------------------------------------------
# Statistics


def usage_entropy(trace: Trace) -> list[float]:
    """Per layer: entropy of the expert-usage distribution over all tokens, divided by log E
    (1.0 = every expert used equally often)."""
    out = []
    for layer in range(trace.num_layers):
        counts = np.bincount(trace.experts[:, layer].reshape(-1), minlength=trace.num_experts)
        p = counts[counts > 0] / counts.sum()
        out.append(float(-(p * np.log(p)).sum() / math.log(trace.num_experts)))
    return out


def reuse_probability(trace: Trace) -> float:
    """P(an expert used by token t in a layer is used by token t+1 in that layer), over
    consecutive tokens of the same segment and all layers. Uniform routing gives k / E."""
    same = trace.segment[1:] == trace.segment[:-1]
    a, b = trace.experts[:-1][same], trace.experts[1:][same]  # [P, L, k]
    if not len(a):
        return float("nan")
    shared = (a[..., :, None] == b[..., None, :]).any(-1).sum(-1)  # [P, L]
    return float(shared.mean() / trace.top_k)


def summary(trace: Trace) -> dict:
    """The numbers the docs report for a trace."""
    ent = usage_entropy(trace)
    return {"name": trace.name, "tokens": len(trace), "decode_tokens": int(trace.decode.sum()),
            "layers": trace.num_layers, "experts": trace.num_experts, "top_k": trace.top_k,
            "entropy_min": round(min(ent), 4), "entropy_mean": round(sum(ent) / len(ent), 4),
            "reuse": round(reuse_probability(trace), 4), "uniform_reuse": round(trace.top_k / trace.num_experts, 4)}


# ---------------------------------------------------------------------------------------------
# Synthetic traces


def synthetic(num_layers: int, num_experts: int, top_k: int, tokens: int, locality: float,
              skew: float = 0.8, prompt: int = 256, seed: int = 0, name: str | None = None) -> Trace:
    """A trace with tunable temporal locality: each of token t's experts is kept for token t+1
    with probability ``locality``; the rest are drawn without replacement from a per-layer Zipf
    popularity (exponent ``skew``, a random expert order per layer). The first ``prompt`` tokens
    are marked as prefill."""
    if not 0 <= locality <= 1 or top_k > num_experts:
        raise ValueError("locality must be in [0, 1] and top_k <= num_experts")
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, num_experts + 1) ** skew
    popularity /= popularity.sum()
    experts = np.zeros((tokens, num_layers, top_k), dtype=np.int16)
    for layer in range(num_layers):
        by_expert = popularity[np.argsort(rng.permutation(num_experts))]  # a random expert order per layer
        prev: np.ndarray | None = None
        for t in range(tokens):
            kept = prev[rng.random(top_k) < locality] if prev is not None else np.empty(0, dtype=np.int64)
            p = by_expert.copy()
            p[kept] = 0.0
            fresh = rng.choice(num_experts, top_k - len(kept), replace=False, p=p / p.sum())
            prev = np.concatenate([kept, fresh])
            experts[t, layer] = prev
    decode = np.arange(tokens) >= prompt
    label = name or f"synthetic-L{num_layers}-E{num_experts}-k{top_k}-loc{locality:g}"
    return Trace(label, num_experts, experts, decode, np.zeros(tokens, dtype=np.int32))


def uniform(num_layers: int, num_experts: int, top_k: int, tokens: int, seed: int = 0) -> Trace:
    """Uniform routing (no locality, no skew): the reference point of the statistics."""
    return synthetic(num_layers, num_experts, top_k, tokens, 0.0, skew=0.0, seed=seed,
                     name=f"uniform-L{num_layers}-E{num_experts}-k{top_k}")


# ---------------------------------------------------------------------------------------------
# Recording from a model


def record(model: str | Path, requests: Iterable[tuple[list[int], int]], name: str) -> Trace:
    """Run ``(prompt ids, tokens to generate)`` requests one at a time through the engine with its
    routing record on, and return the trace (one segment per request)."""
    from hearth.engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "routing.jsonl"
        requests = list(requests)
        longest = max(len(p) + g for p, g in requests)
        with LLM(model, expert_device="virtual", expert_cache=1.0, max_num_seqs=1,
                 max_model_len=longest + 8, record_routing=str(log)) as llm:
            num_experts = llm.engine.model_config.num_experts
            for prompt, gen in requests:
                llm.generate(prompt, SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True))
        steps = [json.loads(line) for line in log.read_text().splitlines()]
    rows, decode, segment = [], [], []
    step_tokens = iter(_tokens_of_steps(steps, num_experts))
    for seg, (prompt, gen) in enumerate(requests):
        for i in range(len(prompt) + gen - 1):  # the last sampled token is never fed back
            rows.append(next(step_tokens))
            decode.append(i >= len(prompt))
            segment.append(seg)
    return Trace(name, num_experts, np.array(rows, dtype=np.int16), np.array(decode), np.array(segment, np.int32))


def _tokens_of_steps(steps: list[dict], num_experts: int) -> Iterable[list[list[int]]]:
    """Token rows [L][k] (local ids) from the engine's per-step routing record (batch of one)."""
    for step in steps:
        layers = sorted(step["layers"], key=int)
        per_layer = [np.array(step["layers"][lay]) % num_experts for lay in layers]  # [T, k] each
        for t in range(per_layer[0].shape[0]):
            yield [ids[t].tolist() for ids in per_layer]


# ---------------------------------------------------------------------------------------------
# The standard recordings of the benchmark suite


def _training_recipe():
    """``tools/train_demo.py`` as a module: the corpus split and chat samples come from there."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "train_demo.py"
    spec = importlib.util.spec_from_file_location("train_demo", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _held_out_texts() -> list[str]:
    """Text the demo model never saw in training (the held-out standard-library files)."""
    return sorted(_training_recipe().corpus(held_out=True), key=len, reverse=True)


def record_held_out(model: str | Path, name: str, segments: int = 16, length: int = 512,
                    prompt: int = 64) -> Trace:
    """Held-out source files run through the model: each segment's first ``prompt`` tokens are
    the prefill and the rest is teacher-forced decode (routing equals decoding that text)."""
    from hearth.engine.text.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    texts = [t for t in _held_out_texts() if len(t) > 6 * length][:segments]
    requests = [(tok.encode(t, add_special_tokens=False)[:length], 1) for t in texts]
    trace = record(model, requests, name)
    first = np.searchsorted(trace.segment, trace.segment)  # index where each token's segment starts
    trace.decode = (np.arange(len(trace)) - first) >= prompt
    return trace


def record_chat(model: str | Path, name: str, sessions: int = 3, turns: int = 4, reply_tokens: int = 160) -> Trace:
    """Multi-turn chat sessions: each user turn asks for a held-out documented function; the
    model's sampled reply joins the history; every turn re-sends the whole conversation."""
    from hearth.engine import LLM, SamplingParams
    from hearth.engine.text.tokenizer import render_chat

    asks = [request for request, _ in _training_recipe().chat_pairs(_held_out_texts(), limit=sessions * turns)]
    turns_ids: list[tuple[list[int], int]] = []  # (prompt + reply ids, prompt length) per turn
    with LLM(model, max_num_seqs=1) as llm:
        for s in range(sessions):
            messages: list[dict] = []
            for t in range(turns):
                messages.append({"role": "user", "content": asks[(s * turns + t) % len(asks)]})
                ids = render_chat(llm.tokenizer, messages)
                out = llm.generate(ids, SamplingParams(max_tokens=reply_tokens, temperature=0.7, seed=s * 100 + t))[0]
                turns_ids.append((list(out.prompt_token_ids) + list(out.token_ids), len(out.prompt_token_ids)))
                messages.append({"role": "assistant", "content": out.text})
    trace = record(model, [(ids, 1) for ids, _ in turns_ids], name)
    # Re-running each turn's prompt plus its sampled reply teacher-forced reproduces the routing
    # the reply had while it was generated; those tokens are the turn's decode.
    starts = np.searchsorted(trace.segment, trace.segment)
    prompt_len = np.array([n for _, n in turns_ids], dtype=np.int64)
    trace.decode = (np.arange(len(trace)) - starts) >= prompt_len[trace.segment]
    return trace


def random_twin(model: str | Path, out: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint of the model's exact shape and tokenizer (transformers' init)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    hf.save_pretrained(str(out))
    for f in Path(model).iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def record_standard(model: str | Path, out_dir: Path) -> list[Path]:
    """The suite's traces: the demo model on held-out code and in chat, and its random twin."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = Path(model).name
    paths = []
    for label, make in ((f"{name}-heldout", lambda: record_held_out(model, f"{name}-heldout")),
                        (f"{name}-chat", lambda: record_chat(model, f"{name}-chat"))):
        save(make(), out_dir / f"{label}.jsonl.gz")
        paths.append(out_dir / f"{label}.jsonl.gz")
    with tempfile.TemporaryDirectory() as tmp:
        twin = random_twin(model, Path(tmp) / f"{name}-random")
        save(record_held_out(twin, f"{name}-random-heldout"), out_dir / f"{name}-random-heldout.jsonl.gz")
    paths.append(out_dir / f"{name}-random-heldout.jsonl.gz")
    return paths


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record the suite's traces from a model (default: the demo model)")
    rec.add_argument("--model", default=None)
    rec.add_argument("--out", type=Path, default=Path("bench/out/traces"))
    st = sub.add_parser("stats", help="usage entropy and reuse probability of trace files")
    st.add_argument("traces", nargs="+", type=Path)
    syn = sub.add_parser("synthetic", help="write a synthetic trace")
    syn.add_argument("out", type=Path)
    syn.add_argument("--layers", type=int, default=48)
    syn.add_argument("--experts", type=int, default=128)
    syn.add_argument("--top-k", type=int, default=8)
    syn.add_argument("--tokens", type=int, default=1024)
    syn.add_argument("--locality", type=float, default=0.5)
    syn.add_argument("--skew", type=float, default=0.8)
    syn.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.cmd == "record":
        if args.model is None:
            from hearth.engine.checkpoint.demo import demo_model_dir

            args.model = demo_model_dir()
        for path in record_standard(args.model, args.out):
            print(json.dumps(summary(load(path))))
    elif args.cmd == "stats":
        for path in args.traces:
            print(json.dumps(summary(load(path))))
    else:
        save(synthetic(args.layers, args.experts, args.top_k, args.tokens, args.locality, args.skew,
                       seed=args.seed), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
