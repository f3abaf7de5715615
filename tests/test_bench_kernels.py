"""bench/kernels.py runs end to end on small weights: a row for every decode library this CPU runs,
format, weight size, token count and mode, each a positive rate, and the machine named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hearth.engine.kernels import cpu as kernels

ROOT = Path(__file__).resolve().parents[1]
_ops = kernels.cpu_decode_ops()


@pytest.mark.skipif(_ops is None, reason="native kernels not available on this machine")
def test_the_kernel_bench_covers_every_library(tmp_path):
    out = tmp_path / "kernels.json"
    run = subprocess.run([sys.executable, "bench/kernels.py", "--mib", "2", "--rounds", "1", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    libraries = {r["library"] for r in result["rows"]}
    assert _ops.isa in libraries <= set(kernels.runnable_isas(_ops.features))  # (a library not built is left out)
    assert len(result["rows"]) == len(libraries) * 6 * 2 * 3 * 2  # formats, sizes, tokens, modes
    assert all(r["gb_s"] > 0 and r["g_weights_s"] > 0 for r in result["rows"])
    assert result["machine"]["cpu"] and result["read_rate_gb_s"] > 0
    assert "| q4_k | cache | 1 | exact |" in run.stdout
