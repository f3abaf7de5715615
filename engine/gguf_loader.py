"""Load a GGUF file (one file, as llama.cpp and Ollama keep it) into the engine's model and pool.

The config comes from the file's metadata through transformers' GGUF support, with what that
mapping leaves out read here (the experts' width, tied embeddings). Tensor names follow the
``gguf`` package's name map, which llama.cpp's converter writes with; experts are stacked per
layer (``blk.N.ffn_{gate,up,down}_exps``). Every tensor is accounted for, as for safetensors.

Experts stay in their blocks, from file to kernel, when the native kernels compute that format
(:data:`~hearth.engine.kernels.BLOCK_KERNELS`; float32 activations, as llama.cpp computes quantized
models, and no shared-memory pool). Everything else is decoded to the compute dtype at load
(float32 by default); see docs/quantization.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hearth.engine.config import parse_dtype
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.gguf_file import ARCHITECTURES, GGUFError, GGUFFile
from hearth.engine.models import build_model, family_for
from hearth.engine.quant.formats import BlockFormat

_EXPERT_PARTS = ("gate", "up", "down")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def gguf_hf_config(f: GGUFFile) -> Any:
    """The transformers config of a GGUF file, completed from its metadata."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(f.path.parent), gguf_file=f.path.name)
    except Exception as exc:  # noqa: BLE001 - transformers' own conversion error, with the file named
        raise GGUFError(f"{f.path}: cannot read its config ({exc})") from None
    # transformers' GGUF mapping leaves the experts' widths at their defaults.
    width = f.metadata(f"{f.architecture}.expert_feed_forward_length")
    if width is not None:
        hf.moe_intermediate_size = int(width)
    shared = f.metadata(f"{f.architecture}.expert_shared_feed_forward_length")
    if shared is not None:
        hf.shared_expert_intermediate_size = int(shared)
    hf.tie_word_embeddings = "output.weight" not in f.tensors
    hf.architectures = [ARCHITECTURES[f.architecture]]
    return hf


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
              pool_factory=None, keep_blocks: bool = True):
    """Build the model of a GGUF file and fill every weight from it (``keep_blocks``: experts may
    stay in their quantized blocks)."""
    import gguf

    from hearth.engine.loader import CheckpointError, LoadedModel

    f = GGUFFile(path)
    family, cfg = _config(f, dtype)
    fmt = _expert_blocks(f, cfg) if pool_factory is None and keep_blocks else None
    pool = ExpertPool(cfg, pool_factory(*ExpertPool.bank_shapes(cfg), cfg.dtype) if pool_factory else None, fmt)
    model = build_model(cfg, LocalExpertBackend(pool, cfg.hidden_act))
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[f.architecture.upper()], cfg.num_layers)
    expected: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        target = names.get_name(base)
        if target is None:
            raise CheckpointError(f"{f.path}: no GGUF name for '{name}' ({cfg.architecture})")
        expected[f"{target}.{suffix}"] = param
    experts = {f"blk.{layer}.ffn_{part}_exps.weight": (layer, part)
               for layer in cfg.moe_layer_ids for part in _EXPERT_PARTS}
    errors = [f"unexpected tensor '{n}'" for n in f.tensors if n not in expected and n not in experts]
    errors += [f"missing tensor '{n}'" for n in [*expected, *experts] if n not in f.tensors]
    if errors:
        more = f"; … and {len(errors) - 6} more" if len(errors) > 6 else ""
        raise CheckpointError(f"{f.path}: does not match its metadata: {'; '.join(errors[:6])}{more}")
    bar = tqdm(total=len(expected) + len(experts), desc="loading tensors", unit="t", disable=not show_progress)
    for name, param in expected.items():
        _copy(f, name, param.data)
        bar.update(1)
    for name, (layer, part) in experts.items():
        _fill_experts(f, name, pool, cfg, layer, part)
        bar.update(1)
    bar.close()
    model.eval()
    return LoadedModel(config=cfg, model=model, pool=pool, model_dir=f.path)


def _expert_blocks(f: GGUFFile, cfg) -> BlockFormat | None:
    """The block format the experts can stay in: one for every expert tensor, with a native kernel."""
    from hearth.engine.kernels import BLOCK_KERNELS, cpu_decode_ops

    formats = {f.tensors[n].format for n in f.tensors if "_exps" in n}
    if len(formats) != 1 or cfg.dtype != torch.float32 or cpu_decode_ops() is None:
        return None
    (fmt,) = formats
    return fmt if isinstance(fmt, BlockFormat) and fmt.name in BLOCK_KERNELS else None


def _copy(f: GGUFFile, name: str, dst: torch.Tensor) -> None:
    t = f.tensors[name]
    if tuple(t.shape) != tuple(dst.shape):
        raise GGUFError(f"{f.path}: tensor '{name}' has shape {list(t.shape)}, expected {list(dst.shape)}")
    dst.copy_(t.dequantized())


def _fill_experts(f: GGUFFile, name: str, pool: ExpertPool, cfg, layer: int, part: str) -> None:
    """``blk.L.ffn_{part}_exps`` [E, out, in] into the pool's banks (gate then up rows in gate_up)."""
    i, h, e = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    t = f.tensors[name]
    want = (e, h, i) if part == "down" else (e, i, h)
    if tuple(t.shape) != want:
        raise GGUFError(f"{f.path}: tensor '{name}' has shape {list(t.shape)}, expected {list(want)}")
    rows = slice(pool.layer_rows(layer), pool.layer_rows(layer) + e)
    values = t.raw() if pool.fmt is not None else t.dequantized()  # blocks as stored, or decoded
    if part == "down":
        pool.down[rows].copy_(values)
    else:  # whole rows in either case: gate rows first, then up rows
        pool.gate_up[rows, (0 if part == "gate" else i):(i if part == "gate" else 2 * i)].copy_(values)
