"""The ``hearth`` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from engine.inspect import summarize
from engine.loader import load_config
from tests.helpers import reference


def hearth(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, input=stdin, timeout=120
    )


def test_help_lists_commands():
    out = hearth("--help")
    assert out.returncode == 0 and "generate" in out.stdout and "inspect" in out.stdout


def test_generate_streams_text_and_reports_speed(checkpoint):
    path, _ = checkpoint("qwen3_moe")
    out = hearth("generate", "--model", str(path), "--prompt", "def fib", "--max-tokens", "16", "--ignore-eos")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "decode: 16 tokens" in out.stderr and "tok/s" in out.stderr


def test_generate_chat_template_and_stdin(checkpoint):
    path, _ = checkpoint("mixtral")
    out = hearth("generate", "--model", str(path), "--prompt", "-", "--chat", "--max-tokens", "4", stdin="hello")
    assert out.returncode == 0, out.stderr


def test_generate_bad_model_is_a_clear_error(checkpoint, tmp_path):
    path, _ = checkpoint("qwen3_moe")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["NopeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    out = hearth("generate", "--model", str(bad), "--prompt", "x")
    assert out.returncode == 1
    assert "hearth: error: unknown architecture ['NopeForCausalLM']" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("family, overrides", [("qwen3_moe", {}), ("qwen2_moe", {}), ("mixtral", {}),
                                               ("qwen3_moe", {"mlp_only_layers": [1], "tie_word_embeddings": True})])
def test_inspect_counts_match_transformers(checkpoint, family, overrides):
    path, _ = checkpoint(family, **overrides)
    out = hearth("inspect", str(path), "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["total_params"] == reference(path).num_parameters()
    _, cfg = load_config(path)
    assert summary == summarize(cfg).as_dict()
    assert summary["expert_bytes"] * summary["num_experts"] * summary["num_moe_layers"] == summary["expert_pool_bytes"]
