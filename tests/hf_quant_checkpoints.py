"""Quantized Hugging Face test checkpoints, as the FP8 and MXFP4 releases ship them, and the check
against transformers on weights transformers itself dequantizes.

- :func:`write_fp8` quantizes a tiny checkpoint's attention projections and experts to float8 e4m3
  with one fp32 scale per 128×128 tile (amax / 448, DeepSeek-V3 / Qwen3-FP8 style: ``weight`` and
  ``weight_scale_inv``, per-expert tensors, everything else bf16, the scales in a shard of their own).
  The reference loads it with ``FineGrainedFP8Config(dequantize=True)``.
- :func:`write_mxfp4` quantizes the experts to MXFP4 (GPT-OSS style: fused
  ``mlp.experts.{gate_up,down}_proj_blocks`` / ``_scales``, everything else bf16). The reference
  decodes them with transformers' ``convert_moe_packed_tensors`` into an fp32 model.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hearth.engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint, record_logits

PROMPTS = [[5, 17, 42, 99, 3], [200, 7, 7, 31], list(range(40, 61))]
# Hidden and expert widths are whole 128-element FP8 tiles (and 32-element MXFP4 blocks), and differ.
SHAPES = {
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=384, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64),
    "mixtral": dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2),
}
FP8_QUANTIZED = re.compile(r"(self_attn\.[qkvo]_proj|experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
              "modules_to_not_convert": ["lm_head", "mlp.gate", "block_sparse_moe.gate"]}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "mlp.gate", "lm_head",
                                                                     "embed_tokens"]}
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def float_checkpoint(root: Path, family: str, **overrides):
    """A tiny fp32 checkpoint of ``family`` (per-expert layout) and the transformers model it came from."""
    return make_checkpoint(root / f"{family}-float", family, **{**SHAPES[family], **overrides})


def quantize_fp8(w: torch.Tensor, tile: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., N, K] (whole tiles) -> float8_e4m3fn [..., N, K] and fp32 scales [..., N / bn, K / bk],
    one per tile: amax / 448, so that the tile's largest value is e4m3's largest."""
    *lead, n, k = w.shape
    bn, bk = tile
    tiles = w.float().reshape(*lead, n // bn, bn, k // bk, bk)
    scale = (tiles.abs().amax((-3, -1)) / 448.0).clamp(min=1e-12)
    q = (tiles / scale[..., :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.reshape(w.shape), scale


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., R, K] -> MXFP4 blocks uint8 [..., R, K / 32, 16] (the low nibble the even element)
    and E8M0 scales uint8 [..., R, K / 32]: per 32 elements the exponent floor(log2 amax) - 2 (E2M1's
    largest exponent), each value rounded to the nearest E2M1 value."""
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-120)
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    x = groups / torch.exp2(exp)[..., None]
    codes = (x[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory's safetensors shards, by name."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            names = f.keys()
            out.update({k: f.get_tensor(k) for k in names})
    return out


def _write(src: Path, dst: Path, shards: list[dict[str, torch.Tensor]], quantization_config: dict) -> Path:
    """Side files of ``src``, ``shards`` as safetensors with an index, and the quantization config."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
    weight_map = {}
    for i, shard in enumerate(s for s in shards if s):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"  # as released: compute dtype bf16
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def write_fp8(src: Path, dst: Path, fused_experts: bool = False, tile: tuple[int, int] = (128, 128)) -> Path:
    """An FP8 block-scaled copy of checkpoint ``src``: attention and experts quantized, per-expert
    tensors (or, with ``fused_experts``, ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``down_proj`` with
    their ``_scale_inv``), the rest bf16. Weights in one shard, all scales in another."""
    weights, scales = {}, {}
    for name, t in read_tensors(src).items():
        if FP8_QUANTIZED.search(name):
            weights[name], scales[name + "_scale_inv"] = quantize_fp8(t, tile)
        else:
            weights[name] = t.to(torch.bfloat16)
    if fused_experts:
        _fuse_fp8_experts(weights, scales)
    return _write(src, dst, [weights, scales], {**FP8_CONFIG, "weight_block_size": list(tile)})


def _fuse_fp8_experts(weights: dict, scales: dict) -> None:
    """Per-expert FP8 tensors (Qwen naming) -> the fused layout, in place."""
    per = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    found: dict[tuple[str, str], dict[int, str]] = {}
    for name in list(weights):
        m = per.match(name)
        if m:
            found.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = name
    for (prefix, part), names in found.items():
        if part == "up_proj":
            continue
        order = [names[e] for e in sorted(names)]
        if part == "gate_proj":
            ups = [names_e for _, names_e in sorted(found[(prefix, "up_proj")].items())]
            w = torch.stack([torch.cat([weights[g].view(torch.uint8), weights[u].view(torch.uint8)])
                             for g, u in zip(order, ups, strict=True)]).view(torch.float8_e4m3fn)
            s = torch.stack([torch.cat([scales[g + "_scale_inv"], scales[u + "_scale_inv"]])
                             for g, u in zip(order, ups, strict=True)])
            fused, drop = f"{prefix}.gate_up_proj", order + ups
        else:
            w = torch.stack([weights[n].view(torch.uint8) for n in order]).view(torch.float8_e4m3fn)
            s = torch.stack([scales[n + "_scale_inv"] for n in order])
            fused, drop = f"{prefix}.down_proj", order
        for n in drop:
            del weights[n], scales[n + "_scale_inv"]
        weights[fused], scales[fused + "_scale_inv"] = w, s


def write_gpt_oss_mxfp4(model, src: Path, dst: Path) -> Path:
    """GPT-OSS's MXFP4 release layout from a float transformers GPT-OSS ``model``: the experts'
    ``gate_up_proj`` [E, H, 2I] (gate and up interleaved) and ``down_proj`` [E, I, H] stored by output
    rows as ``_blocks`` [E, R, K / 32, 16] / ``_scales``; their biases and the rest bf16."""
    weights = {}
    for name, t in model.state_dict().items():
        if re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$", name):
            weights[name + "_blocks"], weights[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            weights[name] = t.to(torch.bfloat16).contiguous()
    return _write(src, dst, [weights], {"quant_method": "mxfp4", "modules_to_not_convert": [
        "self_attn", "mlp.router", "lm_head", "embed_tokens"]})


def write_mxfp4(model, src: Path, dst: Path) -> Path:
    """An MXFP4 copy of the transformers ``model`` (saved as ``src``): its fused experts
    (``mlp.experts.gate_up_proj`` [E, 2I, H], gate rows then up rows, and ``down_proj`` [E, H, I]) as
    ``_blocks`` / ``_scales``, the rest bf16 under the in-memory names."""
    weights = {}
    for name, t in model.state_dict().items():
        if re.search(r"mlp\.experts\.(gate_up_proj|down_proj)$", name):
            weights[name + "_blocks"], weights[name + "_scales"] = quantize_mxfp4(t)
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            weights[name] = t.to(torch.bfloat16).contiguous()
    return _write(src, dst, [weights], MXFP4_CONFIG)


# -- references --------------------------------------------------------------------------------------


def fp8_reference(path: Path):
    """transformers on the FP8 checkpoint, dequantized by its own FP8 integration in fp32 (the bf16
    tensors, which it leaves bf16, widened exactly)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                 dtype=torch.float32)
    return model.float().eval()


def mxfp4_reference(path: Path):
    """An fp32 transformers model of the checkpoint's config, its experts decoded by transformers'
    ``convert_moe_packed_tensors`` (which returns [E, K, R]: transposed back to [E, R, K])."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {}
    tensors = read_tensors(path)
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            decoded = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=torch.float32)
            # [E, K, R]: GPT-OSS's own in-memory layout; the other families' is [E, R, K].
            state[base] = decoded if config.model_type == "gpt_oss" else decoded.transpose(1, 2).contiguous()
        elif not name.endswith("_scales"):
            state[name] = t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (missing, unexpected)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def assert_matches_transformers(ref, path: Path, **engine_options) -> tuple[LLM, float]:
    """fp32: the first token's log-probabilities (all of them) within 1e-4 relative of ``ref``'s, and 32
    greedy tokens equal, on 3 prompts. Returns the engine and the largest relative error seen."""
    llm = LLM(path, **engine_options)
    recorded = record_logits(llm)
    worst = 0.0
    for prompt in PROMPTS:
        with torch.no_grad():
            want = torch.log_softmax(ref(torch.tensor([prompt])).logits[0, -1].float(), -1)
        out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
        got = torch.log_softmax(recorded[out.request_id][0].float(), -1)
        error = float((got - want).abs().max() / want.abs().max())
        worst = max(worst, error)
        assert error <= 1e-4, error
        assert out.chunk.logprobs[0].logprob == pytest.approx(float(want[out.token_ids[0]]), rel=1e-4, abs=1e-6)
        tokens = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        with torch.no_grad():
            expect = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
        assert list(tokens) == expect
    return llm, worst
