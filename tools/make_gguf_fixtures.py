"""Tiny GGUF files of every family, written by llama.cpp's own converter (and its quantizer), for the
tests to read files that hearth did not write.

For each family: a tiny random checkpoint in bf16 (``tests/gguf_fixtures.py``: its recipe, the
tokenizer its converter expects), then ``convert_hf_to_gguf.py`` from a llama.cpp source tree, to
bf16 (lossless: the test reference is transformers on the checkpoint itself) and to Q8_0 (the
converter's own quantization). With llama-cpp-python installed, Q4_K_M too, through the library
behind ``llama-quantize``. The tests make the checkpoints again from their seeds, so only the GGUF
files are kept (and ``MANIFEST.json``: what was written, and why a family was not):

    python tools/make_gguf_fixtures.py --llama-cpp PATH [--families olmoe,glm4_moe] [--out tests/fixtures/gguf]

PATH is a llama.cpp checkout, or the ``vendor/llama.cpp`` of llama-cpp-python's sdist (``pip
download --no-binary :all: --no-deps llama-cpp-python==VERSION``): the converter runs from source,
without building llama.cpp. The Mixtral (llama) converter needs ``sentencepiece`` installed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.gguf_fixtures import CONVERTER_FLAGS, FAMILIES, FIXTURES, fixture_checkpoint  # noqa: E402

# The converter's output types; Q4_K_M is the quantizer's (llama-cpp-python), from the bf16 file.
CONVERTER_TYPES = ("bf16", "q8_0")


def convert(checkpoint: Path, llama_cpp: Path, outtype: str, out: Path, flags: tuple[str, ...]):
    """llama.cpp's converter in a process of its own (it imports its own gguf-py)."""
    call = f"convert(Path({str(checkpoint)!r}), Path({str(llama_cpp)!r}), Path({str(out)!r}), {outtype!r}, {flags!r})"
    code = f"import sys; from pathlib import Path; from bench.peers import convert; {call}"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def make_family(family: str, llama_cpp: Path, out: Path, quantizer: bool) -> dict:
    """Every fixture of one family; what was written, or why not (the converter's last error line)."""
    result: dict = {"family": family, "written": [], "failed": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, _ = fixture_checkpoint(Path(tmp) / family, family)
        for outtype in CONVERTER_TYPES:
            dst = out / f"{family}-{outtype}.gguf"
            done = convert(ckpt, llama_cpp, outtype, dst, CONVERTER_FLAGS.get(family, ()))
            if done.returncode != 0:
                result["failed"][outtype] = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                continue
            result["written"].append(dst.name)
        bf16 = out / f"{family}-bf16.gguf"
        if quantizer and bf16.exists():
            from bench.peers import quantize

            dst = out / f"{family}-q4_k_m.gguf"
            try:
                quantize(bf16, dst, "q4_k_m", 2)
                result["written"].append(dst.name)
            except SystemExit as exc:
                result["failed"]["q4_k_m"] = str(exc)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args(argv)
    if not (args.llama_cpp / "convert_hf_to_gguf.py").is_file():
        ap.error(f"{args.llama_cpp} has no convert_hf_to_gguf.py")
    try:
        import llama_cpp  # noqa: F401 - only whether the quantizer is there
        quantizer = True
    except ImportError:
        quantizer = False
        print("llama-cpp-python is not installed: no Q4_K_M fixtures", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [make_family(f, args.llama_cpp.resolve(), args.out, quantizer) for f in args.families.split(",")]
    for r in results:
        failed = "; ".join(f"{k}: {v}" for k, v in r["failed"].items())
        print(f"{r['family']:<12} {', '.join(r['written']) or '-'}" + (f"  FAILED {failed}" if failed else ""))
    # The manifest keeps the families not made this time (a run with --families updates their entries).
    manifest = args.out / "MANIFEST.json"
    made = {r["family"] for r in results}
    kept = [r for r in json.loads(manifest.read_text()) if r["family"] not in made] if manifest.is_file() else []
    order = {f: i for i, f in enumerate(FAMILIES)}
    entries = sorted(kept + results, key=lambda r: order.get(r["family"], len(order)))
    manifest.write_text(json.dumps(entries, indent=1) + "\n")
    return 0 if all(not r["failed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
