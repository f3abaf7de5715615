"""FTW of quantized models: a GGUF file (Q4_K_M, Q8_0) or an FP8 / MXFP4 Hugging Face checkpoint is
stored in its blocks as it runs, and loading the FTW gives the same model as loading the source:
the same bytes in the same places, the same tokens and logits bit for bit; a damaged bank is caught
by its checksum; the tokenizer and chat template of a GGUF file come along; `hearth inspect` shows
the stored formats."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("gguf")

from hearth.cli.main import main  # noqa: E402
from hearth.engine import LLM  # noqa: E402
from hearth.engine.checkpoint.common import CheckpointError  # noqa: E402
from hearth.engine.checkpoint.dispatch import convert, load_checkpoint  # noqa: E402
from hearth.engine.checkpoint.ftw import VERSION, load_ftw, read_index  # noqa: E402
from hearth.engine.checkpoint.gguf_writer import write_gguf  # noqa: E402
from hearth.engine.kernels.cpu import cpu_decode_ops  # noqa: E402
from tests.helpers import PROMPTS, greedy, record_logits  # noqa: E402

SHAPE = dict(hidden_size=256, moe_intermediate_size=512, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
KERNELS = cpu_decode_ops() is not None
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no native kernels here: blocks are decoded at load")


@pytest.fixture(scope="module")
def hf3(tmp_path_factory):
    from tests.checkpoints import make_checkpoint

    path, _ = make_checkpoint(tmp_path_factory.mktemp("hf3"), "qwen3_moe", num_hidden_layers=3, **SHAPE)
    return path


@pytest.fixture(scope="module")
def gguf_ftw(hf3, tmp_path_factory):
    """Factory: fmt -> (GGUF file, its FTW directory), written once per module."""
    made = {}

    def build(fmt: str):
        if fmt not in made:
            root = tmp_path_factory.mktemp(f"gguf-{fmt}")
            src = write_gguf(hf3, root / f"m-{fmt}.gguf", fmt)
            convert(src, root / "ftw", shard_bytes=256 << 10)  # small shards: the banks span several
            made[fmt] = (src, root / "ftw")
        return made[fmt]

    return build


def assert_same_model(a, b) -> None:
    """Every parameter with the same dtype, shape, block format and bytes; fused attention alike; the
    pool in the same formats with the same bytes in every expert's row (tails excepted)."""
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        x, y = pa[name], pb[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert getattr(x, "block_format", None) == getattr(y, "block_format", None), name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name
    for la, lb in zip(a.model.model.layers, b.model.model.layers, strict=True):
        qa, qb = la.self_attn.qkv_weight, lb.self_attn.qkv_weight
        assert (qa is None) == (qb is None)
        if qa is not None:
            assert qa.dtype == qb.dtype and torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
    assert a.pool.blocks == b.pool.blocks
    assert a.pool.gate_up.shape == b.pool.gate_up.shape and a.pool.down.shape == b.pool.down.shape
    if a.pool.blocks is None:
        assert torch.equal(a.pool.gate_up, b.pool.gate_up) and torch.equal(a.pool.down, b.pool.down)
        return
    for layer, blocks in a.pool.blocks.items():
        rows = slice(a.pool.layer_rows(layer), a.pool.layer_rows(layer) + a.pool.num_experts)
        assert torch.equal(a.pool.gate_up[rows, : blocks.gate_up_bytes], b.pool.gate_up[rows, : blocks.gate_up_bytes])
        assert torch.equal(a.pool.down[rows, : blocks.down_bytes], b.pool.down[rows, : blocks.down_bytes])


def assert_same_outputs(src, ftw, steps: int = 8) -> None:
    """Greedy tokens and every step's logits equal, bit for bit, on 3 prompts."""
    runs = []
    for path in (src, ftw):
        llm = LLM(path)
        rec = record_logits(llm)
        outs = [llm.generate(p, greedy(steps))[0] for p in PROMPTS]
        runs.append([(o.token_ids, torch.stack(rec[o.request_id])) for o in outs])
        llm.engine.close()
    for (ta, la), (tb, lb) in zip(*runs, strict=True):
        assert list(ta) == list(tb) and torch.equal(la, lb)


@pytest.mark.parametrize("fmt", ["q4_k_m", "q8_0", "bf16"])
def test_gguf_to_ftw_keeps_the_blocks(gguf_ftw, fmt) -> None:
    src, ftw = gguf_ftw(fmt)
    index = read_index(ftw)
    assert index["version"] == VERSION == 2 and index["dtype"] == "float32"
    assert len(index["shards"]) > 2 and all(e["offset"] % 4096 == 0 for e in index["tensors"].values())
    gguf = load_checkpoint(src)
    loaded = load_ftw(ftw)
    assert loaded.config == gguf.config  # config.json written from the GGUF metadata reads back the same
    if KERNELS:
        formats = {str(layer): {"gate_up": b.gate_up.name, "down": b.down.name}
                   for layer, b in gguf.pool.blocks.items()}
        assert index["banks"]["blocks"] == formats
        if fmt == "q4_k_m":  # layer 2's down projections in Q6_K, the others in Q4_K; q/k/v unfused there
            assert [b["down"] for b in formats.values()] == ["q4_k", "q4_k", "q6_k"]
            assert loaded.model.model.layers[2].self_attn.qkv_weight is None
        assert loaded.pool.gate_up.dtype == torch.uint8 and loaded.pool.blocks == gguf.pool.blocks
        assert index["tensors"]["model.layers.0.self_attn.q_proj.weight"]["format"] == {"q4_k_m": "q4_k"}.get(fmt, fmt)
        assert loaded.model.lm_head.weight.dtype == torch.uint8
    assert_same_model(gguf, loaded)
    assert_same_outputs(src, ftw)


def test_blocks_are_decoded_where_they_cannot_stay(gguf_ftw) -> None:
    """keep_blocks=False (CPU worker processes) and a pool_factory's float pool: decoded as the GGUF
    loader decodes them."""
    src, ftw = gguf_ftw("q4_k_m")
    decoded = load_ftw(ftw, keep_blocks=False)
    assert decoded.pool.blocks is None and decoded.pool.gate_up.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in decoded.model.parameters())
    assert_same_model(load_checkpoint(src, keep_blocks=False), decoded)

    def factory(gate_up_shape, down_shape, dtype):
        return torch.empty(gate_up_shape, dtype=dtype), torch.empty(down_shape, dtype=dtype)

    shared = load_ftw(ftw, pool_factory=factory)
    assert shared.pool.blocks is None
    assert torch.equal(shared.pool.gate_up, decoded.pool.gate_up) and torch.equal(shared.pool.down, decoded.pool.down)


@pytest.mark.parametrize("method", ["fp8", "mxfp4"])
def test_hf_quantized_checkpoint_to_ftw(tmp_path, method) -> None:
    from tests.hf_quant_checkpoints import float_checkpoint, write_fp8, write_mxfp4

    if method == "fp8":
        src = write_fp8(float_checkpoint(tmp_path, "qwen3_moe")[0], tmp_path / "fp8")
    else:
        from tests.checkpoints import make_checkpoint
        from tests.hf_quant_checkpoints import SHAPES

        hf, model = make_checkpoint(tmp_path / "float", "qwen3_moe", layout="fused", **SHAPES["qwen3_moe"])
        src = write_mxfp4(model, hf, tmp_path / "mxfp4")
    assert main(["convert", str(src), str(tmp_path / "ftw"), "--shard-size", "256KiB"]) == 0
    index = read_index(tmp_path / "ftw")
    fmt = "fp8_e4m3" if method == "fp8" else "mxfp4"
    assert {b["gate_up"] for b in index["banks"]["blocks"].values()} == {fmt}
    assert ("format" in index["tensors"]["model.layers.0.self_attn.q_proj.weight"]) == (method == "fp8")
    assert "quantization_config" in json.loads((tmp_path / "ftw" / "config.json").read_text())
    source, loaded = load_checkpoint(src), load_ftw(tmp_path / "ftw")
    assert loaded.config == source.config
    assert_same_model(source, loaded)
    assert_same_outputs(src, tmp_path / "ftw")


def test_a_flipped_byte_in_a_block_bank_is_caught(gguf_ftw, tmp_path) -> None:
    _, ftw = gguf_ftw("q4_k_m")
    damaged = tmp_path / "damaged"
    shutil.copytree(ftw, damaged)
    index = read_index(damaged)
    piece = index["banks"]["gate_up"][3]
    path = damaged / index["shards"][piece["shard"]]["file"]
    data = bytearray(path.read_bytes())
    data[piece["offset"] + 777] ^= 0x10
    path.write_bytes(bytes(data))
    r0, r1 = piece["rows"]
    with pytest.raises(CheckpointError, match=rf"{path.name}: checksum mismatch in 'expert bank gate_up rows "
                                              rf"{r0}\.\.{r1}'.*corrupt"):
        load_ftw(damaged)
    with pytest.raises(CheckpointError, match="checksum mismatch"):  # decoded as it lands: checked all the same
        load_ftw(damaged, keep_blocks=False)


def test_version_1_directories_still_load(checkpoint, tmp_path) -> None:
    """A float FTW as version 1 wrote it (no per-tensor dtype) loads as before."""
    src, _ = checkpoint("qwen3_moe")
    convert(src, tmp_path / "v1")
    index = json.loads((tmp_path / "v1" / "ftw.json").read_text())
    index["version"] = 1
    for entry in index["tensors"].values():
        del entry["dtype"]
    (tmp_path / "v1" / "ftw.json").write_text(json.dumps(index))
    a, b = load_checkpoint(src), load_ftw(tmp_path / "v1")
    assert_same_model(a, b)


def test_ftw_of_a_gguf_serves_with_its_chat_template(gguf_ftw) -> None:
    import requests

    from hearth.engine.text.tokenizer import load_tokenizer, render_chat
    from tests.serving_helpers import running_server

    src, ftw = gguf_ftw("q8_0")
    assert (ftw / "config.json").is_file() and (ftw / "tokenizer.json").is_file()
    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "def add(a, b):"}]
    want = render_chat(load_tokenizer(src), messages)
    tokenizer = LLM(ftw).tokenizer
    assert render_chat(tokenizer, messages) == want and want.startswith("<|im_start|>system\n")
    assert tokenizer(want).input_ids == load_tokenizer(src)(want).input_ids
    with running_server(ftw, {"max_model_len": 512}, scripted=False) as server:
        r = requests.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(tokenizer(want).input_ids)


def _inspect(capsys, path, as_json: bool = True):
    assert main(["inspect", str(path), *(["--json"] if as_json else [])]) == 0
    out = capsys.readouterr().out
    return json.loads(out) if as_json else out


def test_inspect_shows_the_formats_of_an_fp8_folder_and_a_block_ftw(gguf_ftw, tmp_path, capsys) -> None:
    from tests.hf_quant_checkpoints import float_checkpoint, write_fp8

    fp8 = write_fp8(float_checkpoint(tmp_path, "qwen3_moe")[0], tmp_path / "fp8")
    report = _inspect(capsys, fp8)
    stored = report["stored"]
    assert list(stored["formats"]["experts"]) == ["fp8_e4m3"] and list(stored["formats"]["attention"]) == ["fp8_e4m3"]
    assert list(stored["formats"]["norms"]) == ["bfloat16"] and list(stored["formats"]["router"]) == ["bfloat16"]
    kernels = cpu_decode_ops() is not None  # without them nothing stays in blocks
    assert stored["in_blocks"] == (["attention", "experts"] if kernels else [])
    cfg = json.loads((fp8 / "config.json").read_text())
    h, i, e = cfg["hidden_size"], cfg["moe_intermediate_size"], report["num_experts"]
    per_layer = e * 3 * (h * i + (h // 128) * (i // 128) * 4)  # e4m3 bytes and one fp32 scale per 128x128 tile
    assert stored["formats"]["experts"]["fp8_e4m3"] == cfg["num_hidden_layers"] * per_layer
    text = _inspect(capsys, fp8, as_json=False)
    assert ("attention and experts stay in their blocks" in text or not kernels) and "stored experts" in text

    src, ftw = gguf_ftw("q4_k_m")
    from_ftw, from_gguf = _inspect(capsys, ftw)["stored"], _inspect(capsys, src)["stored"]
    assert set(from_ftw["formats"]["experts"]) == {"q4_k", "q6_k"}
    assert from_ftw["formats"]["output"] == from_gguf["formats"]["output"]
    assert list(from_gguf["formats"]["output"]) == ["q6_k"]
    assert from_ftw["formats"]["experts"] == from_gguf["formats"]["experts"]  # the banks hold no tails
    assert from_ftw["bytes_per_decode_token"] == from_gguf["bytes_per_decode_token"]
    blocks = ["attention", "embedding", "experts", "output"] if kernels else []
    assert from_ftw["in_blocks"] == from_gguf["in_blocks"] == blocks
    text = _inspect(capsys, src, as_json=False)
    assert "Q8_0" not in text
    assert "attention, embedding, experts and output stay in their blocks" in text or not kernels


def test_a_restarted_executor_reattaches_to_a_filled_float_pool(gguf_ftw) -> None:
    """The cluster's host pool fills a float pool from a block FTW; an executor then reads only the
    non-expert tensors (in blocks where they can stay) and computes what the GGUF file computes."""
    src, ftw = gguf_ftw("q4_k_m")

    def factory(gate_up_shape, down_shape, dtype):
        return torch.empty(gate_up_shape, dtype=dtype), torch.empty(down_shape, dtype=dtype)

    filled = load_ftw(ftw, pool_factory=factory).pool
    attached = load_ftw(ftw, filled_pool=(filled.gate_up, filled.down))
    assert attached.pool.gate_up is filled.gate_up and attached.pool.blocks is None
    reference = load_checkpoint(src, pool_factory=factory)  # the GGUF loader: float experts too
    assert_same_model(reference, attached)


def test_scattered_reads_span_many_segments(tmp_path) -> None:
    """More segments than one preadv call takes (IOV_MAX), and extents cut across them."""
    from hearth.engine.checkpoint.ftw import _pread_into, bytes_of, cut

    data = torch.randint(0, 256, (3000 * 7,), dtype=torch.uint8)
    (tmp_path / "f").write_bytes(data.numpy().tobytes())
    bank = torch.zeros(3000, 10, dtype=torch.uint8)  # rows of 10 bytes, the first 7 used
    flat = bytes_of(bank)
    segments = [flat[r * 10 : r * 10 + 7] for r in range(3000)]
    pieces = cut(segments, [5000, 10000, 6000])
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        for start, piece in zip((0, 5000, 15000), pieces, strict=True):
            assert _pread_into(fd, piece, start) == sum(len(p) for p in piece)
    finally:
        os.close(fd)
    assert torch.equal(bank[:, :7].reshape(-1), data) and not bank[:, 7:].any()


def test_the_cluster_converts_a_gguf_file_once_per_version(gguf_ftw, tmp_path) -> None:
    pytest.importorskip("ray")
    from hearth.cluster.actors import ftw_path

    src = shutil.copy(gguf_ftw("q8_0")[0], tmp_path / "m.gguf")
    first = ftw_path(str(src), tmp_path / "cache")
    assert first == ftw_path(str(src), tmp_path / "cache") and first.parent == tmp_path / "cache" / "ftw"
    stat = src.stat()
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new file: converted again
    assert ftw_path(str(src), tmp_path / "cache") != first
