"""Write a tiny Hugging Face checkpoint as a GGUF file, the way llama.cpp's converter lays one out:
its metadata keys, its tensor names (the ``gguf`` package's name map, which the converter uses),
experts stacked per layer (``ffn_{gate,up,down}_exps``), the BPE tokenizer and chat template in
``tokenizer.*`` keys, and each weight in a chosen block format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def write_gguf(hf_dir: Path, out: Path, weight_format: str = "f32") -> Path:
    """``hf_dir``'s checkpoint as one GGUF file; matrices in ``weight_format`` (``f32``, ``f16``
    or a block format), where their rows are whole blocks; norms and biases stay f32."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    if cfg["architectures"] != ["Qwen3MoeForCausalLM"]:
        raise ValueError("this writer knows Qwen3-MoE only")
    arch = gguf.MODEL_ARCH.QWEN3MOE
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(writer, cfg)
    _tokenizer(writer, hf_dir)
    names = gguf.TensorNameMap(arch, cfg["num_hidden_layers"])
    tensors = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
            continue
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:
            raise ValueError(f"no GGUF name for {name}")
        _add(writer, f"{target}.{suffix}", t, weight_format if t.dim() >= 2 else "f32")
    for (layer, part), per_expert in sorted(experts.items()):
        stacked = torch.stack([per_expert[e] for e in sorted(per_expert)])  # [E, out, in]
        _add(writer, f"blk.{layer}.ffn_{part}_exps.weight", stacked, weight_format)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _metadata(writer, cfg: dict) -> None:
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_vocab_size(cfg["vocab_size"])


def _tokenizer(writer, hf_dir: Path) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    size = max([*vocab.values(), *added]) + 1
    tokens = [""] * size
    types = [1] * size  # normal
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = 3 if t.get("special") else 4  # control, user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    ids = {t["content"]: i for i, t in added.items()}
    for key, add in (("eos_token", writer.add_eos_token_id), ("pad_token", writer.add_pad_token_id),
                     ("bos_token", writer.add_bos_token_id)):
        if isinstance(config.get(key), str) and config[key] in ids:
            add(ids[config[key]])
    template = hf_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())


def _add(writer, name: str, t: torch.Tensor, fmt: str) -> None:
    import gguf

    from hearth.engine.quant.formats import FORMATS
    from hearth.engine.quant.quantize import quantize

    x = t.float()
    if fmt in FORMATS and x.shape[-1] % FORMATS[fmt].block_elems == 0:
        rows = quantize(x.reshape(-1, x.shape[-1]), fmt)
        data = rows.reshape(*x.shape[:-1], rows.shape[-1]).numpy()
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type))
    elif fmt == "f16":
        writer.add_tensor(name, x.numpy().astype(np.float16))
    else:
        writer.add_tensor(name, x.numpy())
