"""hearth against llama.cpp on the same GGUF files: decode and prompt processing, interleaved.

Two steps. ``make`` writes the GGUF files with llama.cpp's own tools: its converter
(``convert_hf_to_gguf.py`` from a llama.cpp checkout, bf16) and its quantizer (through
llama-cpp-python's ``llama_model_quantize``: Q8_0, Q4_K_M, …). ``run`` loads each file in both
engines, with the same threads, and times them in alternating rounds on the same token ids:

- ``pp``: prompt processing of ``--prompt`` tokens in one batch (tok/s);
- ``tg``: greedy decode of ``--tokens`` tokens after a short prompt, batch 1 (tok/s).

With ``--int8-activations`` a third engine joins the rounds: hearth in its opt-in int8-activation
mode (the activation quantization llama.cpp's CPU kernels use), for the quantized files.

It prints one row per file and engine with medians, the ratio hearth / llama.cpp, and the share of
the memory roofline that decode reaches (bytes one decode token reads, from ``hearth inspect``,
times tok/s, over a measured streaming read rate: the best of one measurement before the run and two
around each engine's decode, since a VM's memory rate moves; and, as ``tg adjacent``, each decode
against the mean of the two readings around it, the median over the rounds). llama-cpp-python is the ``peers`` extra
(``pip install -e '.[peers]'``; it builds llama.cpp from source, ~15 min on 2 cores). Not part
of CI.

    python bench/random_hf.py /tmp/qwen3-5b --shape 5b   # a model no CPU cache holds (or --shape 1b)
    python bench/peers.py make --model DIR --llama-cpp ~/src/llama.cpp --out /tmp/peer [--quants q8_0 q4_k_m]
    python bench/peers.py run /tmp/peer/*.gguf [--threads 2] [--rounds 5] [--json bench/out/peers.json]
    python bench/peers.py batch /tmp/peer/model-Q4_K_M.gguf [--streams 4] [--peer]   # batched decode (peers_batch.py)
"""

from __future__ import annotations

import argparse
import contextlib
import runpy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hearth  # noqa: E402,F401 - before torch: hearth's OpenMP defaults apply to the process
from bench.common import (  # noqa: E402
    emit,
    machine_facts,
    memory_share,
    read_rate,
    share_label,
    synthetic_prompt,
    worker_process,
)

# llama.cpp's file types (llama.h, enum llama_ftype) by the names its quantize tool takes.
FTYPES = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q4_k_s": 14, "q5_k_m": 17, "q5_k_s": 16, "q6_k": 18,
          "q2_k": 10, "q3_k_m": 12, "iq4_xs": 30}  # llama.cpp's llama_ftype


# -- make ---------------------------------------------------------------------------------------

def convert(model: Path, llama_cpp: Path, out: Path, outtype: str = "bf16", extra: tuple[str, ...] = ()) -> None:
    """llama.cpp's converter on a Hugging Face folder, to ``outtype`` (bf16, f32, q8_0…). A
    tokenizer the converter does not know by its hash (a random test model's) gets the
    pre-tokenizer its tokenizer.json declares (GPT-2's byte-level regex); nothing else of the
    converter is changed."""
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    from conversion import base  # llama.cpp's converter package

    recognised = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", outtype, "--outfile", str(out), *extra]
    runpy.run_path(str(llama_cpp / "convert_hf_to_gguf.py"), run_name="__main__")


def quantize(src: Path, dst: Path, name: str, threads: int) -> None:
    """llama.cpp's quantizer (the library behind its ``llama-quantize`` tool)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize failed for {dst}")


def make(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.model.name
    bf16 = args.out / f"{stem}-bf16.gguf"
    if not bf16.exists():
        convert(args.model, args.llama_cpp, bf16)
    for name in args.quants:
        dst = args.out / f"{stem}-{name.upper()}.gguf"
        if not dst.exists():
            quantize(bf16, dst, name, args.threads)
        print(f"{dst} ({dst.stat().st_size / 1e9:.2f} GB)")
    return 0


# -- run ----------------------------------------------------------------------------------------

def _llama_cpp_worker(conn, path: str, threads: int, n_ctx: int) -> None:
    """llama.cpp in a process of its own (its OpenMP runtime and torch's do not share one process):
    answers (prompt, pp, tg) with {"pp", "tg"} tok/s, greedy, one sequence."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                n_ubatch=512, verbose=False)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompt, pp, tg = job
        out = {}
        if pp:
            llm.reset()
            start = time.perf_counter()
            llm.eval(prompt[:pp])
            out["pp"] = pp / (time.perf_counter() - start)
        if tg:
            llm.reset()
            llm.eval(prompt[:16])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            start = time.perf_counter()
            for _ in range(tg):
                llm.eval([tok])
                tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out["tg"] = tg / (time.perf_counter() - start)
        conn.send(out)
    llm.close()


@contextlib.contextmanager
def llama_cpp_runner(path: Path, threads: int, n_ctx: int):
    """run(prompt, pp, tg) -> {"pp", "tg"} tok/s with llama.cpp, in a worker process."""
    failure = f"llama.cpp could not load {path}"
    with worker_process(_llama_cpp_worker, str(path), threads, n_ctx, failure=failure) as ask:
        yield lambda prompt, pp, tg: ask((prompt, pp, tg))


@contextlib.contextmanager
def hearth_runner(path: Path, dtype: str, n_ctx: int, pp_chunk: int, int8_activations: bool = False):
    """run(prompt, pp, tg) -> {"pp", "tg"} tok/s with hearth's engine (greedy, one sequence)."""
    from hearth.cli.bench_backends import timed_steps
    from hearth.engine import LLM

    llm = LLM(str(path), dtype=dtype, max_model_len=n_ctx, max_num_seqs=1, prefill_chunk=pp_chunk,
              max_num_batched_tokens=max(pp_chunk, 2048), prefix_caching=False, int8_activations=int8_activations)
    engine = llm.engine

    def steps(prompt: list[int], max_tokens: int) -> list[float]:
        return timed_steps(engine, prompt, max_tokens)

    def run(prompt: list[int], pp: int, tg: int) -> dict[str, float]:
        out = {}
        if pp:
            out["pp"] = pp / sum(steps(prompt[:pp], 1))
        if tg:
            times = steps(prompt[:16], tg + 1)
            out["tg"] = tg / sum(times[-tg:])  # the first step is the prompt's
        return out

    try:
        yield run, llm
    finally:
        llm.close()


def has_int8_kernels(path: Path) -> bool:
    """Whether any of the file's tensors is in a format the int8-activation mode computes (a bf16 file's
    weights are not: the mode would change nothing)."""
    from hearth.engine.checkpoint.gguf_reader import GGUFFile
    from hearth.engine.kernels.cpu import int8_mode

    return any(t.quantized and t.format.name in int8_mode.FORMATS for t in GGUFFile(path).tensors.values())


def run(args: argparse.Namespace) -> int:
    import torch

    from hearth.engine.checkpoint.gguf_reader import load_gguf_config
    from hearth.engine.checkpoint.inspect import stored_summary

    torch.set_num_threads(args.threads)
    rates = [read_rate()]
    n_ctx = args.prompt + args.tokens + 64
    result = {"machine": machine_facts(), "threads": args.threads, "rounds": args.rounds, "prompt": args.prompt,
              "tokens": args.tokens, "files": []}
    for path in args.files:
        dtype = args.dtype or "float32"  # GGUF's default (bf16 weights stay bf16 blocks)
        per_token = stored_summary(path, load_gguf_config(path)[1])["bytes_per_decode_token"]
        int8 = args.int8_activations and dtype == "float32" and has_int8_kernels(path)
        engines = ["llama.cpp", "hearth"] + (["hearth int8"] if int8 else [])
        samples: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        with contextlib.ExitStack() as stack:
            runs = {"llama.cpp": stack.enter_context(llama_cpp_runner(path, args.threads, n_ctx))}
            runs["hearth"], llm = stack.enter_context(hearth_runner(path, dtype, n_ctx, args.prompt))
            if "hearth int8" in engines:
                runs["hearth int8"], _ = stack.enter_context(hearth_runner(path, dtype, n_ctx, args.prompt, True))
            vocab = llm.engine.model_config.vocab_size
            prompt = synthetic_prompt(vocab, args.prompt)
            for run in runs.values():
                run(prompt, 32, 4)  # warm-up
            for _ in range(args.rounds):
                for name, run in runs.items():
                    samples[name].append(_timed_round(run, prompt, args, rates))
        result["files"].append(_file_row(path, dtype, per_token, samples, engines))
    roofline = max(rates)  # the best the machine showed in this run: a row above it a cache held
    for row in result["files"]:
        for name in ("llama.cpp", "hearth", "hearth int8"):
            if name in row:
                row[name].update(memory_share(row["bytes_per_decode_token"], row[name]["tg_tok_s"], roofline))
    result["read_rate_gb_s"], result["read_rates_gb_s"] = roofline / 1e9, [round(r / 1e9, 1) for r in rates]
    _print_table(result, args, rates)
    emit(result, args.json)
    return 0


def _timed_round(run, prompt: list[int], args: argparse.Namespace, rates: list[float]) -> dict[str, float]:
    """One engine's round: prompt processing, then decode between two readings of the memory read rate.
    A VM's memory rate moves between rounds (by 1.6x within one run here), so each decode is also set
    against the rate measured around it (``rate``: the mean of the two readings)."""
    out = run(prompt, args.prompt, 0)
    before = read_rate(0.5)
    out.update(run(prompt, 0, args.tokens))
    after = read_rate(0.5)
    rates += [before, after]
    return {**out, "rate": (before + after) / 2}


def _file_row(path: Path, dtype: str, per_token: int, samples: dict[str, list[dict[str, float]]],
              engines: list[str]) -> dict:
    """One file's medians per engine, the ratios to llama.cpp, and decode's share of the read rate
    measured around each round (``tg_share_adjacent``: the median over the rounds)."""
    row = {"file": str(path), "dtype": dtype, "bytes_per_decode_token": per_token}
    for name, taken in samples.items():
        shares = [memory_share(per_token, r["tg"], r["rate"])["roofline_share"] for r in taken]
        row[name] = {"pp_tok_s": statistics.median(r["pp"] for r in taken),
                     "tg_tok_s": statistics.median(r["tg"] for r in taken),
                     "tg_all": [round(r["tg"], 2) for r in taken], "pp_all": [round(r["pp"], 1) for r in taken],
                     "rate_all_gb_s": [round(r["rate"] / 1e9, 1) for r in taken],
                     "tg_share_adjacent": statistics.median(shares),
                     "tg_share_adjacent_all": [round(x, 3) for x in shares]}
    for name in engines[1:]:
        row[name]["tg_ratio"] = row[name]["tg_tok_s"] / row["llama.cpp"]["tg_tok_s"]
        row[name]["pp_ratio"] = row[name]["pp_tok_s"] / row["llama.cpp"]["pp_tok_s"]
    row["tg_ratio"], row["pp_ratio"] = row["hearth"]["tg_ratio"], row["hearth"]["pp_ratio"]
    return row


def _print_table(result: dict, args: argparse.Namespace, rates: list[float]) -> None:
    roofline = max(rates)
    facts = result["machine"]
    print(f"\n{facts['cpu']}, {facts['cpu_id']} ({' '.join(facts['isa'])}; last-level cache "
          f"{facts['last_level_cache_bytes'] / 2**20:.0f} MiB), {facts['date']}\n{args.threads} threads, prompt "
          f"{args.prompt}, decode {args.tokens} tokens, median of {args.rounds} interleaved rounds; memory read rate "
          f"{roofline / 1e9:.1f} GB/s (the best of {len(rates)}: one before the run, one before and one after each "
          f"engine's decode: {min(rates) / 1e9:.1f}-{roofline / 1e9:.1f}); 'adjacent': each decode against the "
          f"rate read around it, median over the rounds\n")
    print("| file | engine | pp tok/s | tg tok/s | tg roofline | tg adjacent | pp ratio | tg ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in result["files"]:
        for name in [n for n in ("llama.cpp", "hearth", "hearth int8") if n in row]:
            r = row[name]
            ratios = (f"{r['pp_ratio']:.2f}x | {r['tg_ratio']:.2f}x" if name != "llama.cpp" else "1.00 | 1.00")
            print(f"| {Path(row['file']).name} | {name} | {r['pp_tok_s']:.1f} | {r['tg_tok_s']:.2f} | "
                  f"{share_label(r)} | {100 * r['tg_share_adjacent']:.0f} % | {ratios} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make", help="write bf16 and quantized GGUF files with llama.cpp's tools")
    mk.add_argument("--model", type=Path, required=True, help="a Hugging Face checkpoint folder")
    mk.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp checkout (its converter)")
    mk.add_argument("--out", type=Path, required=True)
    mk.add_argument("--quants", nargs="+", default=["q8_0", "q4_k_m"], choices=sorted(FTYPES))
    mk.add_argument("--threads", type=int, default=2)
    # The timing options run and batch share (their defaults for rounds and prompt differ).
    timing = argparse.ArgumentParser(add_help=False)
    timing.add_argument("--threads", type=int, default=2)
    timing.add_argument("--tokens", type=int, default=64)
    timing.add_argument("--dtype", default=None,
                        help="hearth's compute dtype (default: float32; bf16 and quantized weights stay as stored)")
    timing.add_argument("--int8-activations", action="store_true",
                        help="hearth's opt-in int8-activation mode (quantized files; run: as a third engine)")
    timing.add_argument("--json", type=Path)
    rn = sub.add_parser("run", parents=[timing], help="time llama.cpp and hearth on GGUF files, interleaved")
    rn.add_argument("files", type=Path, nargs="+")
    rn.add_argument("--rounds", type=int, default=5)
    rn.add_argument("--prompt", type=int, default=512)
    bt = sub.add_parser("batch", parents=[timing],
                        help="hearth alone: N concurrent streams against one, and the bytes they read")
    bt.add_argument("file", type=Path)
    bt.add_argument("--streams", type=int, default=4)
    bt.add_argument("--rounds", type=int, default=3)
    bt.add_argument("--prompt", type=int, default=16)
    bt.add_argument("--flush-cache", action="store_true",
                    help="evict the last-level cache before each step (untimed): weights from DRAM, as a large model's")
    bt.add_argument("--peer", action="store_true", help="llama.cpp decodes the same streams in the same rounds")
    args = ap.parse_args()
    if args.command == "batch":
        from bench.peers_batch import batch

        return batch(args)
    return {"make": make, "run": run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
