"""``bench/gpu_check.py`` is run on a GPU machine rarely, and must then run unchanged: its every
section runs here on the CPU (``--cpu-dry-run``: the virtual device, small models, fixed-shape
steps eager), so a renamed statistic or option breaks this test rather than the GPU run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # (about two minutes: .ci/run runs it with the GPU rehearsal, tools/gpu_rehearsal.sh)
def test_every_section_runs_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-dry-run", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert not report["skipped_sections"]
    rows = {r["check"]: r for r in report["rows"]}
    failed = {name: r for name, r in rows.items() if r["ok"] is False}
    assert not failed
    # Every section left its rows: exactness in both step kinds, both families, every fraction.
    for family, dtype in (("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("qwen3_next", "float32")):
        for fraction in ("0slots", "0.1", "0.37", "1.0"):
            for mode in ("off", "eager"):
                assert rows[f"exact {family} {dtype} cache={fraction} static={mode}"]["tokens_equal"]
    assert rows["exact qwen3_moe float32 cache=0.37 static=eager"]["static_steps"] > 0
    assert rows["no host sync inside a captured step"]["ok"] is None  # needs CUDA: reported as skipped
    for fraction in ("0slots", "0.1", "0.37", "1.0"):
        assert rows[f"speed cache={fraction} static=off"]["bound_tok_s"] > 0
    assert rows["speed cache=1.0 static=eager"]["hit_bytes"] > 0  # all resident: decode hits, no streaming
    assert rows["prefill 512"]["streamed_steps"] > 0
    assert rows["emulated 8 GB GPU"]["cache_fraction"] < rows["emulated 24 GB GPU"]["cache_fraction"]
    assert rows["B_P and B_H on real expert shapes"]["B_P_GBps"] > 0
    assert rows["cache step compiled whole equals eager"]["ok"]
    for family in ("olmoe", "glm4_moe", "deepseek_v3", "deepseek_v2", "minimax_m2", "gpt_oss"):
        assert rows[f"family {family} on the device"]["tokens_equal"]
    assert [t["target"] for t in report["targets"]][:2] == ["every exactness check", "no host sync inside a replay"]
    assert report["targets"][0]["met"] is True


def test_without_cuda_it_says_so() -> None:
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "bench/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout
