"""The choice of decode library (engine/kernels/cpu/dispatch.py): by measurement, cached per
sources and CPU, pinned by HEARTH_CPU_ISA, and named by ``hearth inspect``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hearth.engine.kernels import cpu as kernels
from hearth.engine.kernels.cpu import dispatch

_ops = kernels.cpu_decode_ops()
pytestmark = pytest.mark.skipif(_ops is None, reason="native kernels not available on this machine")
ROOT = Path(__file__).resolve().parents[1]


def _slowed(module, seconds: float) -> SimpleNamespace:
    """A library whose products take ``seconds`` longer (a stand-in for a slower instruction set)."""
    def linear_blocks(*args):
        time.sleep(seconds)
        return module.linear_blocks(*args)
    return SimpleNamespace(linear_blocks=linear_blocks)


def test_the_fastest_library_is_chosen_and_cached(tmp_path):
    fast = _ops._decode
    libraries = {"avx512vnni": _slowed(fast, 2e-4), "avx2": fast}  # the widest first, and slower
    cache = tmp_path / "kernels.json"
    choice = dispatch.choose(libraries, cache, "key-1")
    assert choice.isa == "avx2" and choice.reason.startswith("measured") and "widest, avx512vnni, was slower" \
        in choice.reason
    assert set(choice.timings) == {"avx512vnni", "avx2"} and len(choice.timings["avx2"]) == 12
    assert all(choice.timings["avx512vnni"][c] > choice.timings["avx2"][c] for c in choice.timings["avx2"])
    # cached: the same answer without measuring (a library that would now be faster is not timed)
    again = dispatch.choose({"avx512vnni": fast, "avx2": _slowed(fast, 2e-4)}, cache, "key-1")
    assert again.isa == "avx2" and "cached in" in again.reason
    # another key (other sources or another CPU) measures again, and both entries stay
    other = dispatch.choose({"avx512vnni": fast, "avx2": _slowed(fast, 2e-4)}, cache, "key-2")
    assert other.isa == "avx512vnni" and set(json.loads(cache.read_text())) == {"key-1", "key-2"}


def test_one_library_needs_no_measurement_and_a_broken_cache_is_measured_again(tmp_path):
    assert dispatch.choose({"avx2": _ops._decode}, None, "k").reason == "the only decode library this CPU runs"
    cache = tmp_path / "kernels.json"
    cache.write_text("{not json")
    choice = dispatch.choose({"avx512": _ops._decode, "avx2": _ops._decode}, cache, "k")
    assert choice.reason.startswith("measured") and "k" in json.loads(cache.read_text())


def _in_subprocess(code: str, **env: str) -> str:
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_the_process_loads_the_choice_and_the_pin_wins(tmp_path):
    code = "from hearth.engine.kernels.cpu import cpu_decode_ops as c; o = c(); print(o.isa, '|', o.choice.reason)"
    runnable = kernels.runnable_isas(_ops.features)
    chosen = _in_subprocess(code, HEARTH_CACHE=str(tmp_path))
    assert chosen.split(" | ")[0] in runnable
    if len(runnable) > 1:
        assert (tmp_path / "kernels.json").exists()
    assert _in_subprocess(code, HEARTH_CACHE=str(tmp_path), HEARTH_CPU_ISA="avx2") == \
        "avx2 | pinned by HEARTH_CPU_ISA"


def test_inspect_names_the_kernels(tmp_path, checkpoint):
    path, _ = checkpoint("qwen3_moe")
    out = _in_subprocess(f"from hearth.cli.main import main; main(['inspect', {str(path)!r}, '--json'])",
                         HEARTH_CACHE=str(tmp_path), HEARTH_CPU_ISA="avx2")
    assert json.loads(out)["cpu_kernels"] == {"library": "avx2", "integer_products": "avx2",
                                              "why": "pinned by HEARTH_CPU_ISA"}
