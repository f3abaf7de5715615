"""FTW: convert -> load is bit-exact, and damaged files fail with the shard's name."""

from __future__ import annotations

import json

import pytest
import torch

from hearth.engine import LLM
from hearth.engine.checkpoint.common import CheckpointError
from hearth.engine.checkpoint.dispatch import convert, load_checkpoint
from hearth.engine.checkpoint.ftw import load_ftw, read_index
from hearth.engine.checkpoint.hf import load_model
from tests.helpers import PROMPTS, greedy, record_logits


def assert_same_weights(a, b) -> None:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert torch.equal(a.pool.gate_up, b.pool.gate_up) and torch.equal(a.pool.down, b.pool.down)


@pytest.mark.parametrize("family,layout", [("qwen3_moe", "per_expert"), ("qwen2_moe", "fused"),
                                           ("mixtral", "per_expert"), ("granitemoe_shared", "per_expert"),
                                           ("ernie4_5_moe", "fused"),
                                           ("granitemoehybrid", "per_expert")])
def test_round_trip_is_bit_exact(checkpoint, tmp_path, family, layout):
    src, _ = checkpoint(family, layout)
    convert(src, tmp_path / "ftw", shard_bytes=64 << 10)  # tiny shards: banks span several
    index = read_index(tmp_path / "ftw")
    assert len(index["shards"]) > 2 and len(index["banks"]["gate_up"]) > 1
    assert all(e["offset"] % 4096 == 0 for e in index["tensors"].values())
    assert_same_weights(load_model(src), load_ftw(tmp_path / "ftw"))


def test_dtype_conversion_and_identical_logits(checkpoint, tmp_path):
    src, _ = checkpoint("qwen3_moe")
    convert(src, tmp_path / "bf16", dtype="bfloat16")
    assert read_index(tmp_path / "bf16")["dtype"] == "bfloat16"
    assert_same_weights(load_model(src, "bfloat16"), load_ftw(tmp_path / "bf16"))
    with pytest.raises(Exception, match="convert it again with --dtype"):
        load_ftw(tmp_path / "bf16", "float32")
    convert(src, tmp_path / "fp32")
    outs = []
    for path in (src, tmp_path / "fp32"):
        llm = LLM(path)
        rec = record_logits(llm)
        out = llm.generate(PROMPTS[0], greedy(8))[0]
        outs.append((out.token_ids, torch.stack(rec[out.request_id])))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])
    assert LLM(tmp_path / "fp32").tokenizer is not None  # tokenizer files travel with the weights


@pytest.fixture
def ftw_dir(checkpoint, tmp_path):
    src, _ = checkpoint("qwen3_moe")
    convert(src, tmp_path / "ftw", shard_bytes=256 << 10)
    return tmp_path / "ftw"


def test_flipped_byte_names_the_shard(ftw_dir):
    index = read_index(ftw_dir)
    shard = index["shards"][1]
    path = ftw_dir / shard["file"]
    data = bytearray(path.read_bytes())
    offset = shard["extents"][0][0] + 100
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard['file']}: checksum mismatch"):
        load_ftw(ftw_dir)
    load_ftw(ftw_dir, verify=False)  # --no-verify skips the check


def test_truncated_shard_names_the_shard(ftw_dir):
    index = read_index(ftw_dir)
    path = ftw_dir / index["shards"][-1]["file"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(CheckpointError, match=f"{path.name} is truncated"):
        load_checkpoint(ftw_dir)


def test_version_mismatch_is_clear(ftw_dir):
    index = json.loads((ftw_dir / "ftw.json").read_text())
    index["version"] = 99
    (ftw_dir / "ftw.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="FTW version 99 is not supported"):
        load_ftw(ftw_dir)


def test_loads_into_shared_memory_pool(ftw_dir):
    from hearth.engine.experts.mechanism.host_pool import HostExpertPool

    made = []

    def factory(gu, dn, dtype):
        made.append(HostExpertPool.create(f"test-ftw-{id(made)}", gu, dn, dtype))
        return made[-1].tensors

    loaded = load_ftw(ftw_dir, pool_factory=factory)
    try:
        with HostExpertPool.attach(made[0].name) as other:
            assert torch.equal(other.gate_up, load_ftw(ftw_dir).pool.gate_up)
    finally:
        del loaded
        made[0].close()


@pytest.mark.parametrize("source", ["hf", "q8_0"])
def test_pipeline_stages_read_their_rows_of_an_ftw_directory(checkpoint, tmp_path, source):
    """Each pipeline stage of an FTW directory reads only its own layers' tensors and expert rows,
    also from a float bank piece that straddles the stage boundary (pieces of 3 rows, 8 experts a
    layer) or from blocks (a GGUF file's q8_0): one engine's tokens and logits."""
    from hearth.config import EngineConfig
    from hearth.engine import LLMEngine
    from tests.helpers import max_rel_error

    src, _ = checkpoint("qwen3_moe")
    row = load_model(src).pool.gate_up[0].nbytes
    if source != "hf":
        from hearth.engine.checkpoint.gguf_writer import write_gguf

        src = write_gguf(src, tmp_path / "m.gguf", source)
    convert(src, tmp_path / "ftw", shard_bytes=3 * row)
    ftw = tmp_path / "ftw"
    config = EngineConfig(kv_cache_tokens=512)
    whole = LLM(ftw, config=config)
    cfg = whole.engine.model_config
    later = LLMEngine(ftw, config, layers=(1, cfg.num_layers))
    if source == "hf":
        assert [p["rows"] for p in read_index(ftw)["banks"]["gate_up"]][:3] == [[0, 3], [3, 6], [6, 9]]
        first_row = cfg.moe_layer_ids.index(1) * cfg.num_experts
        assert torch.equal(later.pool.gate_up, whole.engine.pool.gate_up[first_row:])
        assert torch.equal(later.pool.down, whole.engine.pool.down[first_row:])
    else:
        assert later.pool.blocks is not None
    staged = LLM.__new__(LLM)
    staged.engine = LLMEngine(ftw, config, layers=(0, 1), next_stage=later.stage_forward)
    recorded = {"whole": record_logits(whole), "staged": record_logits(staged)}
    outs = {name: llm.generate([PROMPTS[0]], greedy(8))[0] for name, llm in (("whole", whole), ("staged", staged))}
    assert outs["staged"].token_ids == outs["whole"].token_ids
    for a, b in zip(recorded["staged"][outs["staged"].request_id], recorded["whole"][outs["whole"].request_id],
                    strict=True):
        assert max_rel_error(a, b) <= 1e-5
