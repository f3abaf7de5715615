"""GGUF files (one file, as llama.cpp and Ollama keep them): read with the ``gguf`` package, checked
up front, and loaded into the engine's model and pool.

:class:`GGUFFile` opens one file, refuses what hearth cannot run with a one-line error naming
the file and the problem (an architecture it does not serve, a tensor type it has no kernel for,
a row that is not whole blocks, a file cut short), and gives each tensor as its raw bytes in
torch layout: a block-quantized ``[rows…, cols]`` weight is ``uint8 [rows…, row_bytes]`` (see
:mod:`hearth.engine.quant.formats`), a float one its values. Nothing is read until asked for:
the tensors are views of a memory map.

:func:`load_gguf` builds the model. The config comes from the file's metadata through
transformers' GGUF support, with what that mapping leaves out read here (the experts' width, tied
embeddings). Tensor names follow the ``gguf`` package's name map, which llama.cpp's converter
writes with; experts are stacked per layer (``blk.N.ffn_{gate,up,down}_exps``). Every tensor is
accounted for, as for safetensors.

Quantized weights stay in their blocks, from file to kernel, when the native kernels compute their
formats (:data:`~hearth.engine.kernels.cpu.BLOCK_KERNELS`) with float32 activations (the default for
GGUF, as llama.cpp computes quantized models): experts in the pool (one expert a bank row, each
layer in its own formats) unless a shared-memory pool or the expert hierarchy needs float experts,
and the dense projections, the output projection and the embedding table. bf16 tensors stay as
stored in the same way, as hearth's ``bf16`` blocks (fp32 activations times bf16 weights: a bf16 file
takes its own size in memory, not twice it). Everything else (norms, the router, f32 and f16
tensors) is decoded to the compute dtype at load; see docs/quantization.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from tqdm import tqdm

from hearth.engine import hugepages
from hearth.engine.checkpoint import common
from hearth.engine.checkpoint.gguf_experts import expert_blocks, expert_tensors, fill_experts
from hearth.engine.checkpoint.gguf_families import ARCHITECTURES as GGUF_ARCHITECTURES
from hearth.engine.checkpoint.gguf_families import (
    ROPE_PERMUTED,
    composed_tensors,
    gguf_name,
    metadata_config,
    restore,
    split_tensors,
    tensor_name_map,
)
from hearth.engine.checkpoint.gguf_meta import TensorIndex
from hearth.engine.checkpoint.gguf_tensors import (
    GGUFError,
    GGUFTensor,
    kernel_format,
    stored_rows,
)
from hearth.engine.config import parse_dtype
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.models import build_model, family_for
from hearth.engine.ops import block_weight
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.registry import FORMATS, REGISTRY

# GGUF architecture -> the transformers class hearth serves it as ("llama" with experts is Mixtral).
ARCHITECTURES = MappingProxyType({name: spec.hf_architecture for name, spec in GGUF_ARCHITECTURES.items()})
log = logging.getLogger(__name__)
_FLOAT_TYPES = MappingProxyType({0: torch.float32, 1: torch.float16, 30: torch.bfloat16})  # GGML type ids
_BLOCK_TYPES = REGISTRY.by_ggml_type()


class GGUFFile:
    """An opened, checked GGUF file."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # deferred: the gguf package is needed for GGUF files only

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        try:
            reader = gguf.GGUFReader(self.path)
        except (ValueError, IndexError, OSError) as exc:  # the reader maps past the end of a cut file
            raise GGUFError(f"{self.path}: not a complete GGUF file (truncated or corrupt: {exc})") from None
        self._fields = reader.fields
        self.architecture = str(self.metadata("general.architecture", ""))
        if self.architecture not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise GGUFError(f"{self.path}: GGUF architecture '{self.architecture}' is not supported "
                            f"(supported: {known})")
        if self.architecture == "llama" and not self.metadata("llama.expert_count"):
            raise GGUFError(f"{self.path}: a dense llama model (no llama.expert_count); hearth serves "
                            "mixture-of-experts models (llama with experts: Mixtral)")
        size = self.path.stat().st_size
        self.tensors: dict[str, GGUFTensor] = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the innermost dimension first
            fmt = self._format(t.name, int(t.tensor_type), t.tensor_type.name, shape[-1])
            if int(t.data_offset) + int(t.n_bytes) > size:
                raise GGUFError(f"{self.path}: truncated: tensor '{t.name}' ends past the end of the file")
            self.tensors[t.name] = GGUFTensor(t.name, shape, fmt, t.data)

    def _format(self, name: str, type_id: int, type_name: str, cols: int) -> BlockFormat | torch.dtype:
        if type_id in _FLOAT_TYPES:
            return _FLOAT_TYPES[type_id]
        fmt = _BLOCK_TYPES.get(type_id)
        if fmt is None:
            supported = ", ".join(["F32", "F16", "BF16", *(f.name.upper() for f in FORMATS.values())])
            raise GGUFError(f"{self.path}: tensor '{name}' has type {type_name}, which hearth has no kernel for "
                            f"(supported: {supported})")
        if cols % fmt.block_elems:
            raise GGUFError(f"{self.path}: tensor '{name}': rows of {cols} elements are not whole "
                            f"{fmt.block_elems}-element {type_name} blocks")
        return fmt

    def meta(self, key: str, default: Any = None) -> Any:
        """A metadata value of this file's architecture (``{architecture}.{key}``), or ``default``."""
        return self.metadata(f"{self.architecture}.{key}", default)

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value (strings decoded, arrays as lists), or ``default``."""
        field = self._fields.get(key)
        if field is None:
            return default
        return field.contents()

    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def formats(self) -> dict[str, int]:
        """Bytes stored per format name (``q4_k``, ``float32``, …)."""
        out: dict[str, int] = {}
        for t in self.tensors.values():
            key = t.format.name if t.quantized else str(t.format).removeprefix("torch.")
            out[key] = out.get(key, 0) + t.nbytes
        return out


def permute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows from the Hugging Face rotary layout (halves) to GGUF ``llama``'s (interleaved
    pairs), as llama.cpp's converter writes them; :func:`unpermute_rope_rows` undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)





# The rotary frequencies' divisors llama.cpp's converter writes for llama3-style scaling.
ROPE_FACTORS = "rope_freqs.weight"


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def gguf_hf_config(f: GGUFFile) -> Any:
    """The transformers config of a GGUF file, completed from its metadata."""
    hf = _read_config(f)
    # transformers' GGUF mapping leaves the experts' widths at their defaults.
    width = f.metadata(f"{f.architecture}.expert_feed_forward_length")
    if width is not None:
        hf.moe_intermediate_size = int(width)
    shared = f.metadata(f"{f.architecture}.expert_shared_feed_forward_length")
    if shared is not None:
        hf.shared_expert_intermediate_size = int(shared)
    hf.tie_word_embeddings = "output.weight" not in f.tensors
    if ROPE_FACTORS in f.tensors:  # (llama3-style scaling, as the converter writes it: per-channel divisors)
        factors = [float(v) for v in f.tensors[ROPE_FACTORS].dequantized().flatten()]
        hf.rope_parameters = {**(hf.rope_parameters or {}), "freq_factors": factors}
    if GGUF_ARCHITECTURES[f.architecture].model_type is None:  # (hearth's own mapping names the class)
        hf.architectures = [ARCHITECTURES[f.architecture]]
    if f.architecture == "llama":  # transformers reads a llama; with experts it is a Mixtral
        from transformers import MixtralConfig  # deferred: as above

        fields = {k: v for k, v in hf.to_dict().items() if k not in ("model_type", "transformers_version")}
        hf = MixtralConfig(**fields, num_local_experts=int(f.metadata("llama.expert_count")),
                           num_experts_per_tok=int(f.metadata("llama.expert_used_count")))
        hf.architectures = ["MixtralForCausalLM"]
    return hf


def _read_config(f: GGUFFile) -> Any:
    """transformers' config of the file: by its GGUF support, or from the metadata by hearth's
    mapping where transformers has none for the architecture (see ``gguf_families``)."""
    from transformers import AutoConfig  # deferred: transformers is heavy to import; only configs need it

    try:
        if GGUF_ARCHITECTURES[f.architecture].model_type is None:
            return AutoConfig.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
        vocab = f.tensors["token_embd.weight"].shape[0]  # the embedding's rows (the token list may be shorter)
        special = {name: f.metadata(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "pad")}
        has = TensorIndex({name: t.shape for name, t in f.tensors.items()})
        return metadata_config(f.architecture, f.meta, has, vocab, special)
    except Exception as exc:  # noqa: BLE001 - a conversion error, with the file named
        raise GGUFError(f"{f.path}: cannot read its config ({exc})") from None


def load_gguf_config(path: str | Path, dtype: str | torch.dtype | None = None):
    """(family, ModelConfig) of a GGUF file."""
    f = GGUFFile(path)
    return _config(f, dtype)


def _config(f: GGUFFile, dtype: str | torch.dtype | None):
    hf = gguf_hf_config(f)
    family = family_for(hf.architectures)
    # f.path (a file) as the "directory": no generation_config.json beside it is read by mistake.
    return family, family.parse_config(hf, f.path, parse_dtype({}, dtype))


def load_gguf(path: str | Path, dtype: str | torch.dtype | None = None, show_progress: bool = False,
              pool_factory: common.PoolFactory | None = None, keep_blocks: bool = True, for_storage: bool = False,
              layers: tuple[int, int] | None = None) -> common.LoadedModel:
    """Build the model of a GGUF file and fill every weight from it (``keep_blocks``: quantized
    weights may stay in their blocks; ``for_storage``: they do even where the native kernels do not
    run here, as ``hearth convert`` writes them to FTW; ``layers``: only the tensors of the pipeline
    stage holding layers [first, end))."""

    f = GGUFFile(path)
    family, cfg = _config(f, dtype)
    if layers is not None:
        cfg = common.stage_config(cfg, layers)
    keep_blocks = keep_blocks and common.blocks_can_stay(cfg, kernels=not for_storage)
    blocks = expert_blocks(f, cfg) if pool_factory is None and keep_blocks else None
    pool = ExpertPool(cfg, pool_factory(*ExpertPool.bank_shapes(cfg), cfg.dtype) if pool_factory else None, blocks)
    model = build_model(cfg, LocalExpertBackend(pool, cfg.hidden_act))
    _compose(f)
    _split(f)
    known, expected = _dense_tensors(f, cfg, model)
    known.add(ROPE_FACTORS)  # (read into the config: see gguf_hf_config)
    known |= set(expert_tensors(cfg, [layer for layer, moe in enumerate(cfg.moe_layers) if moe]))
    experts = expert_tensors(cfg, cfg.moe_layer_ids)
    beyond = [n for n in f.tensors if n not in known and _layer_of(n) >= cfg.num_layers]
    if beyond:  # multi-token-prediction (nextn) layers, counted in block_count: not computed here
        log.info("skipped %d tensors of %s's multi-token-prediction layers (blk.%d and on)", len(beyond),
                 cfg.architecture, cfg.num_layers)
    errors = [f"unexpected tensor '{n}'" for n in f.tensors if n not in known and n not in beyond]
    errors += [f"missing tensor '{n}'" for n in [*expected, *experts] if n not in f.tensors]
    if errors:
        more = f"; … and {len(errors) - 6} more" if len(errors) > 6 else ""
        raise common.CheckpointError(f"{f.path}: does not match its metadata: {'; '.join(errors[:6])}{more}")
    bar = tqdm(total=len(expected) + len(experts), desc="loading tensors", unit="t", disable=not show_progress)
    for name, (param_name, param) in expected.items():
        _load_dense(f, name, param, model, keep_blocks, cfg, param_name)
        bar.update(1)
    common.adopt_blocks(model)
    for name, (layer, part) in experts.items():
        fill_experts(f.path, name, f.tensors[name], pool, cfg, layer, part)
        bar.update(1)
    bar.close()
    model.eval()
    return common.LoadedModel(config=cfg, model=model, pool=pool, model_dir=f.path)


def _compose(f: GGUFFile) -> None:
    """Put together the tensors the converter wrote as parts (see ``gguf_families.composed_tensors``),
    as float tensors in place of their parts."""
    for name, (parts, compose) in composed_tensors(f.architecture, set(f.tensors), f.meta).items():
        if name in f.tensors:
            continue
        values = compose(*(f.tensors[part].dequantized() for part in parts)).contiguous()
        f.tensors[name] = GGUFTensor(name, tuple(values.shape), torch.float32, values.numpy())
        for part in parts:
            del f.tensors[part]


def _split(f: GGUFFile) -> None:
    """Split the tensors the converter wrote fused (see ``gguf_families.split_tensors``) into their
    parts, as stored: rows of blocks or of values are each part's rows as they are."""
    for name, (parts, rows) in split_tensors(f.architecture, set(f.tensors), f.meta).items():
        fused, start = f.tensors.pop(name), 0
        if sum(rows) != fused.shape[0]:
            raise GGUFError(f"{f.path}: tensor '{name}' has {fused.shape[0]} rows, expected {sum(rows)}")
        data = fused.data.reshape(fused.shape[0], -1)  # [rows, row bytes or values]
        for part, n in zip(parts, rows, strict=True):
            f.tensors[part] = GGUFTensor(part, (n, *fused.shape[1:]), fused.format, data[start : start + n])
            start += n


def _layer_of(name: str) -> int:
    """The layer of a ``blk.N.*`` tensor (-1 for the others)."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1


def _dense_tensors(f: GGUFFile, cfg, model) -> tuple[set[str], dict[str, tuple[str, torch.nn.Parameter]]]:
    """(every non-expert tensor name the whole model reads, this stage's: GGUF name -> parameter),
    the names from llama.cpp's own table (see :func:`gguf_families.gguf_name`)."""

    names = tensor_name_map(f.architecture, cfg.num_layers)
    known: set[str] = set()  # (a pipeline stage loads its own of them)
    expected: dict[str, tuple[str, torch.nn.Parameter]] = {}  # GGUF name -> (the model's name, parameter)
    for name, param in model.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        target = gguf_name(names, name, f.architecture)
        if target is None:
            raise common.CheckpointError(f"{f.path}: no GGUF name for '{name}' ({cfg.architecture})")
        known.add(target)
        if common.stage_owns(name, cfg):
            expected[target] = (name, param)
    return known, expected


def _load_dense(f: GGUFFile, name: str, param: torch.nn.Parameter, model, keep_blocks: bool, cfg,
                param_name: str = "") -> None:
    """One non-expert tensor into its parameter: a 2-D weight in a block format with a kernel
    replaces the parameter by its blocks (uint8 [rows, row bytes], tagged ``block_format``); the
    rest is decoded into the parameter. GGUF ``llama`` and ``granitemoe`` files keep q/k rows in the
    interleaved rotary order: they are put back in the Hugging Face order (rows of blocks move as a
    whole)."""
    t = f.tensors[name]
    heads = {".attn_q.": cfg.num_heads, ".attn_k.": cfg.num_kv_heads} if f.architecture in ROPE_PERMUTED else {}
    unpermute = next((n for key, n in heads.items() if key in name), None)
    reorder = (lambda x: unpermute_rope_rows(x, unpermute)) if unpermute else (lambda x: x)
    exact = tuple(t.shape) == tuple(param.shape)
    # the converter drops unit dimensions: a [1, H] gate stored as [H], a [C, 1, K] convolution as [C, K]
    squeezed = [d for d in t.shape if d != 1] == [d for d in param.shape if d != 1]
    restored = restore(f.architecture, param_name, t.dequantized, f.meta) if param_name else None
    if restored is not None and restored.numel() == param.numel():  # values or shapes the converter changed
        param.data.copy_(restored.reshape(param.shape))  # (see gguf_families.restore): decoded
        return
    if not exact and not squeezed:
        raise GGUFError(f"{f.path}: tensor '{name}' has shape {list(t.shape)}, expected {list(param.shape)}")
    fmt = kernel_format(t) if keep_blocks and param.dim() == 2 and exact else None
    if fmt is None:
        param.data.copy_(reorder(t.dequantized().reshape(param.shape)))
        return
    raw = stored_rows(t, reorder)
    blocks = hugepages.empty(*raw.shape, dtype=raw.dtype).copy_(raw)  # a copy: the file's map can close
    common.replace_parameter(model, param, block_weight(blocks, fmt))
