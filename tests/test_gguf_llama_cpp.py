"""GGUF files made by llama.cpp's own tools (its converter, then its quantizer) load in hearth and
match transformers on the same file. Opt-in: set HEARTH_LLAMA_CPP to a llama.cpp checkout (for
``convert_hf_to_gguf.py``) and install llama-cpp-python (the ``peers`` extra, for the quantizer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gguf_checkpoints import assert_matches_transformers

LLAMA_CPP = os.environ.get("HEARTH_LLAMA_CPP")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not LLAMA_CPP, reason="HEARTH_LLAMA_CPP (a llama.cpp checkout) is not set")]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("family", "shape"), [("qwen3_moe", {"moe_intermediate_size": 512, "intermediate_size": 256}),
                                               ("mixtral", {"intermediate_size": 512})])
def test_llama_cpp_files_match_transformers(tmp_path, family, shape) -> None:
    pytest.importorskip("llama_cpp")
    from bench.peers import quantize
    from tests.checkpoints import make_checkpoint

    hf, _ = make_checkpoint(tmp_path / "hf", family, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_hidden_layers=3, dtype="bfloat16", **shape)
    bf16 = tmp_path / "m-bf16.gguf"
    code = ("import sys; from pathlib import Path; sys.argv = ['convert']; from bench.peers import convert; "
            f"convert(Path({str(hf)!r}), Path({LLAMA_CPP!r}), Path({str(bf16)!r}))")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)  # its own process
    for name in ("q8_0", "q4_k_m"):
        out = tmp_path / f"m-{name}.gguf"
        quantize(bf16, out, name, 2)
        assert_matches_transformers(out)
    assert_matches_transformers(bf16)
