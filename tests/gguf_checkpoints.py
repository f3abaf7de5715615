"""GGUF test files: tiny Hugging Face checkpoints written by hearth's own GGUF writer (the layout of
llama.cpp's converter; see :mod:`hearth.engine.checkpoint.gguf_writer`), and the check against transformers
loading the same file (which decodes it with the ``gguf`` package, independently of hearth)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hearth.engine import LLM, SamplingParams
from hearth.engine.checkpoint.gguf_families import tensor_name_map
from hearth.engine.checkpoint.gguf_writer import write_gguf

__all__ = ["assert_matches_transformers", "dequantized_reference", "reference", "write_gguf"]
PROMPTS = [[5, 17, 42, 99, 3], [200, 7, 7, 31], list(range(40, 61))]


def reference(path: Path):
    """transformers on the GGUF file itself, with the widths its GGUF mapping leaves out."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hearth.engine.checkpoint.gguf_reader import GGUFFile, gguf_hf_config

    f = GGUFFile(path)
    config = gguf_hf_config(f)
    if f.architecture == "llama":
        return _mixtral_reference(path, config)
    assert AutoConfig.from_pretrained(path.parent, gguf_file=path.name).num_experts == config.num_experts
    model, info = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                       dtype=torch.float32, ignore_mismatched_sizes=True,
                                                       output_loading_info=True)
    mismatched = [str(key) for key in info.get("mismatched_keys", [])]
    assert all("shared_expert_gate" in key for key in mismatched), mismatched
    _shared_expert_gates(model, path)
    return model.eval()


def _shared_expert_gates(model, path: Path) -> None:
    """Qwen2-MoE's shared-expert gate, which llama.cpp's converter stores as [1, 1, H] and
    transformers' GGUF loading then drops for a size mismatch (and leaves at random): set from the
    ``gguf`` package's decoding of the file, as stored."""
    import gguf

    for t in gguf.GGUFReader(path).tensors:
        if t.name.endswith(".ffn_gate_inp_shexp.weight"):
            layer = int(t.name.split(".")[1])
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").reshape(1, -1)
            with torch.no_grad():
                model.model.layers[layer].mlp.shared_expert_gate.weight.copy_(torch.from_numpy(values.copy()))


def dequantized_reference(path: Path, model: Any) -> Any:
    """``model`` (transformers, of the checkpoint the file was made from) with every weight replaced
    by the file's, as the ``gguf`` package decodes it, found by llama.cpp's own name table (the
    ``gguf`` package's ``TensorNameMap``, which its converter writes with); stacked experts
    ``ffn_{gate,up,down}_exps`` go back to transformers' fused ``gate_up_proj`` / ``down_proj``,
    and what the converter changed in the hybrids is undone (``tests/gguf_hybrid_reference.py``).
    The reference for families whose GGUF files transformers does not read."""
    import gguf

    from tests.gguf_hybrid_reference import adjusted, hybrid_weight

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = tensor_name_map(arch, layers)
    tensors = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32").copy())
               for t in reader.tensors}
    if arch in ("granitemoe", "granitehybrid"):  # llama's q/k rows in rotary order, put back by transformers' code
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        processor = LlamaTensorProcessor(config=model.config.to_dict())
        tensors = {n: torch.from_numpy(processor.process(t.numpy(), n).weights.copy()) for n, t in tensors.items()}
    model = model.float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = hybrid_weight(arch, name, tensors, model.config)
            if value is None:
                value = adjusted(arch, name, _file_weight(name, tuple(param.shape), tensors, names, arch == "llama4"),
                                 model.config)
            param.copy_(value.reshape(param.shape))
    return model.eval()


def _file_weight(name: str, shape: tuple[int, ...], tensors: dict[str, torch.Tensor], names: Any,
                 transposed: bool = False) -> torch.Tensor:
    """The file's tensor for transformers' parameter ``name`` of ``shape``. Experts: transformers'
    fused ``gate_up_proj`` [E, 2I, H] (gate rows, then up), or GPT-OSS's [E, H, 2I] with gate and up
    interleaved column by column (its biases likewise) and ``down_proj`` [E, I, H], or Llama 4's
    [E, H, 2I] and [E, I, H]."""
    layer = name.split(".")[2] if name.startswith(("model.layers.", "transformer.blocks.")) else None
    special = _special_weight(name, layer, tensors)
    if special is not None:
        return special
    if any(f".{part}.experts." in name for part in ("mlp", "block_sparse_moe", "feed_forward")):
        layer, part = name.split(".")[2], name.rsplit(".", 1)[1]
        kind = "bias" if part.endswith("_bias") else "weight"
        gate, up, down = (tensors.get(f"blk.{layer}.ffn_{p}_exps.{kind}") for p in ("gate", "up", "down"))
        gpt_oss = f"blk.{layer}.ffn_gate_exps.bias" in tensors  # (the experts with biases)
        if transposed:  # Llama 4's: [E, H, 2I] and [E, I, H]
            return (down if part.startswith("down") else torch.cat([gate, up], 1)).transpose(1, 2)
        if part.startswith("down"):
            return down.transpose(1, 2) if gpt_oss and kind == "weight" else down
        if not gpt_oss:
            return torch.cat([gate, up], 1)
        if kind == "bias":
            return torch.stack([gate, up], -1).reshape(shape)
        return torch.stack([gate, up], -1).permute(0, 2, 1, 3).reshape(shape)  # [E, H, 2I], interleaved
    base, suffix = name.rsplit(".", 1)
    target = names.get_name(base)
    if target is None:  # a bare parameter, as the converter names it (GPT-OSS's sinks)
        target, suffix = names.get_name(name), "weight"
    assert target is not None, f"no GGUF name for {name}"
    if target.endswith(".attn_kv_b") and f"{target}.{suffix}" not in tensors:
        # llama.cpp's converter splits DeepSeek's kv_b_proj [heads x (nope + v), rank] per head into
        # attn_k_b [heads, rank, nope] (transposed) and attn_v_b [heads, v, rank]
        k_b, v_b = (tensors[target.replace("kv_b", part) + ".weight"] for part in ("k_b", "v_b"))
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])
    return tensors[f"{target}.{suffix}"]


_KIMI_DECAY = {"A_log": "ssm_a", "dt_bias": "ssm_dt.bias", "f_a_proj.weight": "ssm_f_a.weight",
               "f_b_proj.weight": "ssm_f_b.weight"}


def _special_weight(name: str, layer: str | None, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Names that llama.cpp's table does not hold as transformers has them in memory: Granite MoE's
    router and its shared expert's gate and up rows (one tensor in transformers, two in the file),
    ERNIE-4.5's and AfMoE's correction biases (parameters, of the router's ``moe_statics`` and of the MoE
    block), Mamba-2's A, D and dt bias."""
    if ".mamba." in name and name.rsplit(".", 1)[1] in ("A_log", "D", "dt_bias"):  # Mamba-2's bare parameters
        part = name.rsplit(".", 1)[1]
        names = {"A_log": f"blk.{layer}.ssm_a", "D": f"blk.{layer}.ssm_d"}
        stored = tensors[names.get(part, f"blk.{layer}.ssm_dt.bias")]
        return torch.log(-stored) if part == "A_log" else stored  # (the converter stores A = -exp(A_log))
    if name.endswith(".self_attn.conv1d.weight"):  # Kimi's q, k and v convolutions, fused in memory
        parts = [tensors[f"blk.{layer}.ssm_conv1d_{p}.weight"] for p in "qkv"]
        return torch.cat([t.reshape(-1, 1, t.shape[-1]) for t in parts])
    if ".self_attn.forget_gate." in name:  # Kimi's decay: the converter stores A = -exp(A_log)
        part = name.rsplit(".forget_gate.", 1)[1]
        stored = tensors[f"blk.{layer}." + _KIMI_DECAY[part]]
        return torch.log(-stored) if part == "A_log" else stored
    if name.endswith((".mlp.gate.moe_statics.e_score_correction_bias", ".mlp.expert_bias",
                      ".mlp.gate.e_score_correction_bias")):  # (the last: Laguna's, a parameter)
        return tensors[f"blk.{layer}.exp_probs_b.bias"]
    if ".ffn.experts.mlp." in name:  # DBRX's experts: w1, v1 and w2, each [E * I, H] (w2 down's transpose)
        part = name.rsplit(".", 1)[1]
        stored = tensors[f"blk.{layer}.ffn_{ {'w1': 'gate', 'v1': 'up', 'w2': 'down'}[part]}_exps.weight"]
        return stored.transpose(1, 2) if part == "w2" else stored
    if name.endswith(".block_sparse_moe.router.weight"):
        return tensors[f"blk.{layer}.ffn_gate_inp.weight"]
    if name.endswith(".shared_mlp.input_linear.weight"):
        return torch.cat([tensors[f"blk.{layer}.ffn_{p}_shexp.weight"] for p in ("gate", "up")])
    if name.endswith(".shared_mlp.output_linear.weight"):
        return tensors[f"blk.{layer}.ffn_down_shexp.weight"]
    return None


_MIXTRAL_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
                  "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}


def _mixtral_reference(path: Path, config):
    """transformers' Mixtral on a GGUF ``llama`` file's tensors, which transformers' GGUF loading
    does not read for Mixtral: decoded by the ``gguf`` package, q/k rows put back by transformers'
    own llama tensor processor, stacked into transformers' expert layout."""
    import gguf
    from transformers import MixtralForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config=config.to_dict())
    weights, experts = {}, {}
    for t in gguf.GGUFReader(path).tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype("float32")
        data = processor.process(data, t.name).weights
        tensor = torch.from_numpy(data.copy())
        top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        if t.name in top:
            weights[top[t.name]] = tensor
            continue
        _, layer, kind, _ = t.name.split(".")
        if kind.endswith("_exps"):
            experts[(int(layer), kind)] = tensor
        else:
            weights[f"model.layers.{layer}.{_MIXTRAL_NAMES[kind]}.weight"] = tensor
    for layer in range(config.num_hidden_layers):
        gate, up = experts[(layer, "ffn_gate_exps")], experts[(layer, "ffn_up_exps")]
        weights[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        weights[f"model.layers.{layer}.mlp.experts.down_proj"] = experts[(layer, "ffn_down_exps")]
    model = MixtralForCausalLM(config).float().eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model


def assert_matches_transformers(path: Path, ref: Any = None, **engine_options) -> LLM:
    """fp32: the first token's log-probability within 1e-4 of transformers on the same file (or
    ``ref``, a transformers model holding the file's weights), and 32 greedy tokens equal, on 3
    prompts. Returns the engine."""
    ref = ref if ref is not None else reference(path)
    llm = LLM(path, **engine_options)
    width = getattr(ref.config, "moe_intermediate_size", None) or getattr(ref.config, "intermediate_size", None) \
        or ref.config.ffn_config.ffn_hidden_size  # (Mixtral: one width; DBRX's in its FFN config)
    assert llm.engine.model_config.moe_intermediate_size == width
    for prompt in PROMPTS:
        with torch.no_grad():
            want = ref(torch.tensor([prompt])).logits[0, -1]
        out = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=0))[0]
        got = torch.log_softmax(want, -1)[out.token_ids[0]]
        assert out.chunk.logprobs[0].logprob == pytest.approx(float(got), abs=1e-4)
        tokens = llm.generate(prompt, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        assert_greedy_within_a_tie(ref, prompt, list(tokens))
    return llm


TIE = 1e-3  # log-probability: two tokens closer than this are a tie that rounding may break either way


def assert_greedy_within_a_tie(ref: Any, prompt: list[int], tokens: list[int]) -> None:
    """``tokens`` are ``ref``'s greedy continuation of ``prompt``: each is its argmax given the
    tokens before it, or, at the first place they differ, a tie with it (random tiny models have
    near-flat distributions); after a tie the continuations may part, so the check ends there."""
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    for i, token in enumerate(tokens):
        row = logprobs[len(prompt) + i - 1]
        best = int(row.argmax())
        if token != best:
            assert float(row[best] - row[token]) < TIE, (i, token, best, float(row[best] - row[token]))
            return
