"""The soak (``-m slow``): ``bench/reliability.py``'s soak row, shortened, against ``hearth serve``
in its own process on loopback: 4 clients streaming for 3 minutes, resident memory after the first
minute within 5 %, no errors. The full 30-minute soak, the schema fuzz and the other rows are the
benchmark's (docs/serving.md gives the figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_a_short_soak_holds_memory_flat_without_errors(tmp_path):
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "reliability.py"), "--only", "soak",
                          "--soak-minutes", "3", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["row"] == "soak" and row["errors"] == 0, row
    assert row["growth"] < 0.05, row
