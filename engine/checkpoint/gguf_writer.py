"""Write a Hugging Face checkpoint as one GGUF file, quantized (``hearth convert --quant``).

The layout is the one llama.cpp's converter writes: its metadata keys, its tensor names (the
``gguf`` package's name map), experts stacked per layer (``ffn_{gate,up,down}_exps``), the BPE
tokenizer and chat template in ``tokenizer.*`` keys. Weights are quantized by
:func:`hearth.engine.quant.registry.quantize`. A *mix* picks a format per tensor as llama.cpp's presets of
the same name do (``q4_k_m``: Q4_K, with Q6_K for the output projection and for the attention
values and down projections of a third of the layers); norms, biases and the router stay f32.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from hearth.engine.checkpoint.common import FUSED
from hearth.engine.checkpoint.gguf_families import ROPE_PERMUTED, UNLISTED, gguf_name, tensor_name_map
from hearth.engine.checkpoint.gguf_reader import permute_rope_rows
from hearth.engine.checkpoint.gguf_spm import write_sentencepiece
from hearth.engine.checkpoint.gguf_write_families import (
    WRITE_FAMILIES,
    ConvertError,
    WriteFamily,
    common_fields,
    nextn_layers,
)
from hearth.engine.models import config_architectures, family_for
from hearth.engine.quant.registry import FORMATS, REGISTRY, quantize

FLOAT_TYPES = ("f32", "f16", "bf16")
# What the converter keeps in f32 beyond the 1-D tensors: the convolutions (the hybrids' DeltaNet,
# LFM2's short convolution), Mamba-2's A, D and gated norm (stored 2-D) and the sparse attention
# indexer's per-head weights.
_KEPT_F32 = re.compile(r"\.(ssm_conv1d(_[qkv])?|shortconv\.conv)\.|\.ssm_(a|d|norm\.weight)$|\.indexer\.proj\.weight$")
# Mixes: (base format, format of the tensors that get more bits), as the formats' modules declare them.
MIXES = REGISTRY.mixes()
# What it can write: the formats with an encoder.
QUANTS = (*FLOAT_TYPES, *sorted(n for n, f in FORMATS.items() if f.encode is not None), *sorted(MIXES))
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class WriteSummary:
    """What :func:`write_gguf` wrote: tensors per format, and the fallbacks where a tensor's rows
    were not whole blocks of the format its preset asked for ((asked, written) -> tensors)."""

    formats: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)

    def describe(self) -> str:
        return ", ".join(f"{fmt} {n}" for fmt, n in self.formats.most_common())


def fitting_format(fmt: str, cols: int) -> str:
    """``fmt`` where a row of ``cols`` values is whole blocks of it; otherwise the best format that
    fits, as llama.cpp's quantizer falls back: Q8_0 (32-value blocks) where the rows allow, else f16."""
    if fmt not in FORMATS or cols % FORMATS[fmt].block_elems == 0:
        return fmt
    return "q8_0" if cols % FORMATS["q8_0"].block_elems == 0 else "f16"


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers whose sensitive tensors get the larger format in a K mix: the
    first and last eighth, and every third layer between."""
    eighth = num_layers // 8
    return layer < eighth or layer >= num_layers - eighth or (layer - eighth) % 3 == 2


def tensor_format(name: str, quant: str, num_layers: int) -> str:
    """The format a GGUF tensor ``name`` (a matrix) is written in for ``quant``."""
    if quant not in MIXES:
        return quant
    base, more = MIXES[quant]
    if name == "output.weight":
        return more
    layer = _LAYER.match(name)
    sensitive = any(part in name for part in (".attn_v.", ".ffn_down.", ".ffn_down_exps.", ".ffn_down_shexp."))
    return more if layer and sensitive and more_bits(int(layer.group(1)), num_layers) else base


def write_gguf(hf_dir: str | Path, out: str | Path, quant: str = "f32", show_progress: bool = False,
               summary: WriteSummary | None = None) -> Path:
    """``hf_dir``'s checkpoint as one GGUF file at ``out``, its matrices in ``quant`` (see
    :data:`QUANTS`) where their rows are whole blocks (else :func:`fitting_format`); norms, biases
    and the router stay f32. ``summary``, if given, is filled with what was written."""
    import gguf  # deferred: the gguf package is needed for GGUF files only

    hf_dir, out = Path(hf_dir), Path(out)
    if quant not in QUANTS:
        raise ConvertError(f"unknown quantization '{quant}' (known: {', '.join(QUANTS)})")
    cfg = json.loads((hf_dir / "config.json").read_text())
    archs = config_architectures(cfg)
    if len(archs) != 1 or archs[0] not in WRITE_FAMILIES:
        raise ConvertError(f"{hf_dir}: GGUF writing supports {', '.join(WRITE_FAMILIES)}, not {archs}")
    spec = WRITE_FAMILIES[archs[0]]
    cfg = spec.config(cfg)
    # (the GGUF name of the gguf.MODEL_ARCH member, or of one the released package does not list yet)
    arch = UNLISTED[spec.arch][0] if spec.arch in UNLISTED else \
        gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, spec.arch)]
    family = family_for(archs)
    layers = cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, cfg, quant, spec)
    _tokenizer(writer, hf_dir, spec, cfg)
    tensors = spec.prepare({name: load for name, load in _read_tensors(hf_dir).items() if spec.keeps(name, cfg)}, cfg)
    names = tensor_name_map(arch, layers + (nextn_layers(cfg) if spec.nextn else 0))
    dense, experts, fused = _sort_tensors(tensors, family, names, hf_dir, arch)
    stacked = _stacked_experts(tensors, experts, fused, cfg["moe_intermediate_size"] if "moe_intermediate_size" in cfg
                               else cfg["intermediate_size"])
    bar = tqdm(total=len(dense) + len(stacked), desc=f"writing {quant}", unit="t", disable=not show_progress)
    summary = summary if summary is not None else WriteSummary()
    heads = {".attn_q.": cfg["num_attention_heads"], ".attn_k.": cfg["num_key_value_heads"]}
    for target, name in dense:
        t = tensors[name]()
        if arch in ROPE_PERMUTED:
            for key, n in heads.items():
                if key in target:
                    t = permute_rope_rows(t, n)
        # (norms, biases, the routers, the shared experts' gate [1, H] and the convolutions stay f32)
        router = ".ffn_gate_inp" in target and not (spec.quantized_router and quant not in MIXES)
        for part, tp in spec.tensors(target, t, cfg):
            matrix = tp.dim() >= 2 and not router and not part.endswith(".bias") and not _KEPT_F32.search(part)
            _add(writer, part, tp, tensor_format(part, quant, layers) if matrix else "f32", summary)
        bar.update(1)
    for (layer, part), load in sorted(stacked.items()):
        target = f"blk.{layer}.ffn_{part}_exps.weight"
        _add(writer, target, load(), tensor_format(target, quant, layers), summary)
        bar.update(1)
    bar.close()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _sort_tensors(tensors: dict, family, names, hf_dir: Path, arch: str) -> tuple[list, dict, dict]:
    """The checkpoint's tensors by kind: dense ones as (GGUF name, name), per-expert ones as
    {(layer, gate|up|down): {expert: name}}, fused ones as {(layer, gate_up_proj|down_proj): name}."""
    experts: dict[tuple[int, str], dict[int, str]] = {}
    fused: dict[tuple[int, str], str] = {}
    dense = []
    for name in tensors:
        canonical = family.map_name(name)
        m, f = _EXPERT.match(canonical), FUSED.match(canonical)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = name
            continue
        if f:
            fused[(int(f.group(1)), f.group(2))] = name
            continue
        target = gguf_name(names, canonical, arch)
        if target is None:
            raise ConvertError(f"{hf_dir}: no GGUF name for tensor '{name}'")
        dense.append((target, name))
    return dense, experts, fused


def _stacked_experts(tensors: dict, experts: dict, fused: dict, inter: int) -> dict:
    """(layer, gate|up|down) -> a function giving that layer's experts stacked [E, out, in], from
    per-expert tensors or the fused layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])."""
    out = {key: (lambda names=names: torch.stack([tensors[names[e]]() for e in sorted(names)]))
           for key, names in experts.items()}
    for (layer, part), name in fused.items():
        if part == "down_proj":
            out[(layer, "down")] = tensors[name]
        else:
            out[(layer, "gate")] = lambda name=name: tensors[name]()[:, :inter]
            out[(layer, "up")] = lambda name=name: tensors[name]()[:, inter:]
    return out


def _read_tensors(hf_dir: Path) -> dict:
    """name -> a function loading that tensor (read one at a time: a checkpoint may not fit twice)."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no safetensors files")
    loaders = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                loaders[key] = lambda f=f, key=key: _load_one(f, key)
    return loaders


def _load_one(path: Path, key: str) -> torch.Tensor:
    with safe_open(str(path), "pt") as handle:
        return handle.get_tensor(key)


_TOKEN_KEYS = MappingProxyType({"unk": "unknown", "pad": "padding"})  # kinds whose GGUF key is spelled out


def _token_text(value) -> str | None:
    """A tokenizer config's special token: its text, whether written as a string or as an AddedToken."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k": 14, "q4_k_m": 15, "q5_k": 16, "q5_k_m": 17,
               "q6_k": 18, "bf16": 32, "mxfp4": 38}


def _metadata(writer, cfg: dict, quant: str, spec: WriteFamily) -> None:
    import gguf  # deferred: the gguf package is needed for GGUF files only

    fields = common_fields(cfg)
    spec.fields(cfg, fields)
    for key, value in fields.items():
        if key.startswith("."):
            writer.add_array(f"{writer.arch}{key}", value)
            continue
        if key == "expert_gating_func":
            value = gguf.ExpertGatingFuncType(value)
        elif key == "rope_scaling_type":
            value = gguf.RopeScalingType(value)
        getattr(writer, f"add_{key}")(value)
    writer.add_string("general.quantization", quant)
    if quant in _FILE_TYPES:  # llama.cpp's llama_ftype, as its converter and quantizer record it
        writer.add_file_type(_FILE_TYPES[quant])
    writer.add_quantization_version(2)  # GGML_QNT_VERSION


def _tokenizer(writer, hf_dir: Path, family: WriteFamily, cfg: dict) -> None:
    if family.vocab == "spm":
        write_sentencepiece(writer, hf_dir, cfg)
        config_path = hf_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if "add_prefix_space" in config:
            writer.add_add_space_prefix(config["add_prefix_space"])
        return
    config_path = hf_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    vocab, added, merges = _bpe_files(hf_dir, config)
    size = max([*vocab.values(), *added]) + 1
    tokens = [""] * size
    types = [1] * size  # normal
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]
        types[i] = 3 if t.get("special") else 4  # control, user-defined
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t["content"]: i for i, t in added.items()}  # (the converter names special tokens among the added ones)
    # As the converter's special vocabulary: the tokenizer config's tokens, else config.json's ids,
    # else the tokens the family's converter names.
    named = {kind: _token_text(config.get(f"{kind}_token")) for kind in ("bos", "eos", "unk", "pad")}
    chosen = {kind: ids[text] for kind, text in named.items() if text in ids}
    for kind in ("bos", "eos", "unk", "pad"):
        if kind not in chosen and isinstance(cfg.get(f"{kind}_token_id"), int) and 0 <= cfg[f"{kind}_token_id"] < size:
            chosen[kind] = cfg[f"{kind}_token_id"]
    for kind, text in family.special_tokens.items():
        if kind not in chosen and text in ids:
            chosen[kind] = ids[text]
    for kind, token in chosen.items():
        writer.add_uint32(f"tokenizer.ggml.{_TOKEN_KEYS.get(kind, kind)}_token_id", token)
    for kind in ("bos", "eos"):  # (whether encoding adds them, where the tokenizer config says: DeepSeek's BOS)
        if isinstance(config.get(f"add_{kind}_token"), bool):
            writer.add_bool(f"tokenizer.ggml.add_{kind}_token", config[f"add_{kind}_token"])
    template = hf_dir / "chat_template.jinja"
    if template.is_file():
        writer.add_chat_template(template.read_text())
    elif isinstance(config.get("chat_template"), str):
        writer.add_chat_template(config["chat_template"])


def _bpe_files(hf_dir: Path, config: dict) -> tuple[dict[str, int], dict[int, dict], list[str]]:
    """A byte-level BPE tokenizer's vocabulary, added tokens (id -> {content, special}) and merges:
    from ``tokenizer.json``, or from GPT-2's ``vocab.json`` + ``merges.txt`` with the added tokens
    the tokenizer config lists (and the special tokens it names, as transformers marks them)."""
    if (hf_dir / "tokenizer.json").is_file():
        spec = json.loads((hf_dir / "tokenizer.json").read_text())
        if spec["model"]["type"] != "BPE":
            raise ConvertError(f"{hf_dir}: GGUF writing supports BPE tokenizers, not {spec['model']['type']}")
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        return spec["model"]["vocab"], {t["id"]: t for t in spec.get("added_tokens", [])}, merges
    if not (hf_dir / "vocab.json").is_file() or not (hf_dir / "merges.txt").is_file():
        tiktoken = sorted(f.name for f in hf_dir.glob("*tiktoken*"))
        shipped = f" (it ships a tiktoken tokenizer, {', '.join(tiktoken)}, which hearth does not convert yet: " \
                  "llama.cpp's converter does)" if tiktoken else ""
        raise ConvertError(f"{hf_dir}: no tokenizer.json, nor GPT-2's vocab.json and merges.txt{shipped}")
    vocab = json.loads((hf_dir / "vocab.json").read_text())
    lines = (hf_dir / "merges.txt").read_text().splitlines()
    merges = [line for line in lines if line and not line.startswith("#version")]
    added = {int(i): t for i, t in config.get("added_tokens_decoder", {}).items()}
    for kind in ("bos", "eos", "unk", "pad"):
        text = _token_text(config.get(f"{kind}_token"))
        if text in vocab and vocab[text] not in added:
            added[vocab[text]] = {"content": text, "special": True}
    return vocab, added, merges


def _add(writer, name: str, t: torch.Tensor, asked: str, summary: WriteSummary) -> None:
    import gguf  # deferred: the gguf package is needed for GGUF files only

    x = t.float()
    fmt = fitting_format(asked, x.shape[-1])
    summary.formats[fmt] += 1
    if fmt != asked:
        summary.fallbacks[(asked, fmt)] += 1
    if fmt in FORMATS:
        rows = quantize(x.reshape(-1, x.shape[-1]), fmt)
        data = rows.reshape(*x.shape[:-1], rows.shape[-1]).numpy()
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type))
    elif fmt == "f16":
        writer.add_tensor(name, x.numpy().astype(np.float16))
    elif fmt == "bf16":
        bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(name, bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        writer.add_tensor(name, x.numpy())
