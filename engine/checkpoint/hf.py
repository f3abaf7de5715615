"""Hugging Face checkpoint directories: their config (:func:`load_hf_config`) and their safetensors
into the engine's model and expert pool (:func:`load_model`).

Accepts sharded or single-file safetensors, the per-expert expert layout
(``mlp.experts.{e}.gate_proj.weight`` …) and the fused one (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]). Every tensor is accounted for: a missing, unexpected or
mis-shaped tensor is an error naming it, never a silent partial load.

Checkpoints quantized as shipped (FP8 block-scaled, MXFP4 experts) are read by
:mod:`hearth.engine.checkpoint.hf_quant`, their quantized tensors kept in blocks.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from hearth.engine.checkpoint.common import (
    FUSED,
    LAYER,
    PER_EXPERT,
    ROWS,
    CheckpointError,
    LoadedModel,
    PoolFactory,
    adopt_blocks,
    blocks_can_stay,
    stage_config,
    stage_owns,
)
from hearth.engine.checkpoint.hf_quant import QuantLoader, expert_blocks, quant_spec
from hearth.engine.config import ConfigError, ModelConfig, parse_dtype, read_config_json
from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.experts.pool import ExpertPool
from hearth.engine.models import MoECausalLM, build_model, config_architectures, family_for
from hearth.engine.ops import deinterleave

log = logging.getLogger(__name__)

# Tensors no family computes with: rotary caches, multi-token-prediction heads, vision and audio towers.
# (ERNIE-4.5 names its multi-token-prediction parts mtp_block, mtp_emb_norm, mtp_hidden_norm, mtp_linear_proj)
_UNUSED = re.compile(r"rotary_emb\.inv_freq$|^(model\.)?(mtp|mtp_[a-z_]+|visual|vision_tower|vision_model"
                     r"|multi_modal_projector|audio_tower)\.")
# Tensors stored fused that a model holds as parts (rows in order): a dense gated MLP's gate and up
# (Granite's ``shared_mlp.input_linear``), attention's q, k and v (DBRX's ``Wqkv``), Kimi delta
# attention's q, k and v convolutions as transformers holds them in memory.
_FUSED_PARTS = ((re.compile(r"^(.+)\.gate_up_proj\.weight$"), ("gate_proj.weight", "up_proj.weight")),
                (re.compile(r"^(.+\.self_attn)\.qkv_proj\.weight$"),
                 ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
                (re.compile(r"^(.+\.self_attn)\.conv1d\.weight$"),
                 ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")))
_BIASED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias)$")
_BIASED_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@dataclass
class _Progress:
    """Which expected tensors have been filled, to report anything missing at the end."""

    params: set[str]
    experts: set[tuple[int, int, str]]
    errors: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # tensors the model does not use
    stray: list[str] = field(default_factory=list)  # tensors that belong to no module (skipped, as transformers does)


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> shard file, from ``model.safetensors.index.json`` or the shards present."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from exc
        missing = sorted({f for f in weight_map.values() if not (model_dir / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return {name: model_dir / f for name, f in weight_map.items()}
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    names: dict[str, Path] = {}
    for shard in shards:
        with open_safetensors(shard) as f:
            names.update(dict.fromkeys(f.keys(), shard))
    return names


def open_safetensors(path: Path):
    """A shard's safetensors handle (a context manager); a corrupt header is a CheckpointError."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: cannot read safetensors file (truncated or corrupt?): {exc}") from exc


def _check_shape(name: str, tensor_shape: tuple[int, ...], expected: tuple[int, ...], errors: list[str]) -> bool:
    if tuple(tensor_shape) != tuple(expected):
        errors.append(f"tensor '{name}' has shape {list(tensor_shape)}, expected {list(expected)}")
        return False
    return True


def _load_expert(name: str, canonical: str, f, cfg: ModelConfig, pool: ExpertPool, progress: _Progress) -> bool:
    """Copy an expert tensor (either layout) into the pool; False when the name is not an expert.

    ``name`` is the tensor's name in the file, ``canonical`` its name after the family's mapping.
    """
    if cfg.expert_bias:
        return _load_biased_experts(name, canonical, f, cfg, pool, progress)
    i, h, n_exp = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    per = PER_EXPERT.match(canonical)
    fused = FUSED.match(canonical) if per is None else None
    rows = ROWS.match(canonical)
    if per is None and fused is None and rows is None:
        return False
    layer = int((per or fused or rows).group(1))
    if layer >= cfg.num_layers or not cfg.moe_layers[layer]:
        progress.errors.append(f"unexpected tensor '{name}': layer {layer} has no experts")
        return True
    base = pool.layer_rows(layer)
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if rows is not None:
        _load_expert_rows(name, rows.group(2), f, cfg, pool, layer, progress)
        return True
    if per is not None:
        expert, part = int(per.group(2)), per.group(3)
        if expert >= n_exp:
            progress.errors.append(f"unexpected tensor '{name}': expert {expert} >= num_experts {n_exp}")
            return True
        expected = (h, i) if part == "down_proj" else (i, h)
        if _check_shape(name, shape, expected, progress.errors):
            _float_tensor(name, f)
            row = base + expert
            dst = {"gate_proj": pool.gate_up[row, :i], "up_proj": pool.gate_up[row, i:], "down_proj": pool.down[row]}
            dst[part].copy_(f.get_tensor(name))
            progress.experts.discard((layer, expert, part))
        return True
    part = fused.group(2)
    expected = (n_exp, 2 * i, h) if part == "gate_up_proj" else (n_exp, h, i)
    if cfg.experts_transposed:
        expected = (expected[0], expected[2], expected[1])
    if _check_shape(name, shape, expected, progress.errors):
        _float_tensor(name, f)
        dst = pool.gate_up if part == "gate_up_proj" else pool.down
        t = f.get_tensor(name)
        dst[base : base + n_exp].copy_(t.transpose(1, 2) if cfg.experts_transposed else t)
        parts = ("gate_proj", "up_proj") if part == "gate_up_proj" else ("down_proj",)
        for e in range(n_exp):
            for p in parts:
                progress.experts.discard((layer, e, p))
    return True


def _load_expert_rows(name: str, part: str, f, cfg: ModelConfig, pool: ExpertPool, layer: int,
                      progress: _Progress) -> None:
    """One of a layer's ``gate_rows``/``up_rows``/``down_rows`` ([E * I, H], down's transposed) into
    the pool's rows of every expert."""
    i, h, n_exp, base = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts, pool.layer_rows(layer)
    if not _check_shape(name, tuple(f.get_slice(name).get_shape()), (n_exp * i, h), progress.errors):
        return
    _float_tensor(name, f)
    t = f.get_tensor(name).view(n_exp, i, h)
    if part == "down":
        pool.down[base : base + n_exp].copy_(t.transpose(1, 2))
    else:
        pool.gate_up[base : base + n_exp, (0 if part == "gate" else i) : (i if part == "gate" else 2 * i)].copy_(t)
    for e in range(n_exp):
        progress.experts.discard((layer, e, f"{part}_proj"))


def _load_biased_experts(name: str, canonical: str, f, cfg: ModelConfig, pool: ExpertPool,
                         progress: _Progress) -> bool:
    """GPT-OSS's fused expert tensors into the pool: ``gate_up_proj`` [E, H, 2I] with gate and up
    interleaved column by column, ``down_proj`` [E, I, H], and their biases [E, 2I] and [E, H];
    stored as the pool's [2I, H] (gate rows, then up rows) and [H, I], each bias as the last column."""
    match = _BIASED.match(canonical)
    if match is None:
        return False
    layer, part = int(match.group(1)), match.group(2)
    if layer >= cfg.num_layers or not cfg.moe_layers[layer]:
        progress.errors.append(f"unexpected tensor '{name}': layer {layer} has no experts")
        return True
    i, h, n = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    expected = {"gate_up_proj": (n, h, 2 * i), "gate_up_proj_bias": (n, 2 * i), "down_proj": (n, i, h),
                "down_proj_bias": (n, h)}[part]
    if not _check_shape(name, tuple(f.get_slice(name).get_shape()), expected, progress.errors):
        return True
    _float_tensor(name, f)
    t = f.get_tensor(name)
    rows = slice(pool.layer_rows(layer), pool.layer_rows(layer) + n)
    if part.startswith("gate_up"):
        t = deinterleave(t)  # gate columns, then up
    blocks = pool.layer_blocks(layer)
    if blocks is not None and part.endswith("_bias"):  # fp32 after each expert's blocks
        bank, start = (pool.gate_up, blocks.gate_up_bytes) if part == "gate_up_proj_bias" else \
            (pool.down, blocks.down_bytes)
        bank[rows, start : start + 4 * t.shape[1]].copy_(t.float().contiguous().view(torch.uint8))
    elif blocks is not None:
        progress.errors.append(f"tensor '{name}' is float, the checkpoint's other experts are in blocks")
        return True
    elif part == "gate_up_proj":
        pool.gate_up[rows, :, :h].copy_(t.transpose(1, 2))
    elif part == "gate_up_proj_bias":
        pool.gate_up[rows, :, h].copy_(t)
    elif part == "down_proj":
        pool.down[rows, :, :i].copy_(t.transpose(1, 2))
    else:
        pool.down[rows, :, i].copy_(t)
    for e in range(n):
        progress.experts.discard((layer, e, part))
    return True


def _load_tensors(model_dir: Path, cfg, model: MoECausalLM, pool: ExpertPool, family, show_progress: bool,
                  quant=None, keep_dense: bool = False):
    """Every tensor into the model and the pool; ``quant`` (a :class:`~hearth.engine.checkpoint.hf_quant.QuantSpec`):
    the checkpoint's quantized tensors, kept in blocks (dense ones where ``keep_dense``)."""
    files = checkpoint_files(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    # (a parameter marked ``optional`` keeps its default where the checkpoint lacks it: A.X K1's
    # correction bias, which its releases do not ship and transformers leaves at zero)
    expected = {name for name, param in params.items()
                if stage_owns(name, cfg) and not getattr(param, "optional", False)}
    expected -= {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    parts = _BIASED_PARTS if cfg.expert_bias else ("gate_proj", "up_proj", "down_proj")
    experts = {(l, e, p) for l in cfg.moe_layer_ids for e in range(cfg.num_experts) for p in parts}
    progress = _Progress(params=expected, experts=experts)
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    bar = tqdm(total=len(files), desc="loading tensors", unit="t", disable=not show_progress)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(path: Path):  # a quantized weight's scale may sit in another shard
            if path not in handles:
                handles[path] = stack.enter_context(open_safetensors(path))
            return handles[path]

        reader = None
        if quant is not None:
            reader = QuantLoader(quant, files, handle, cfg, model, pool, keep_dense, progress)
        for path, names in by_file.items():
            f = handle(path)
            present = set(f.keys())
            for name in names:
                bar.update(1)
                if name not in present:
                    progress.errors.append(f"tensor '{name}' is listed in the index but absent from {path.name}")
                    continue
                _load_one(name, family.map_name(name), f, cfg, params, pool, progress, reader)
        if reader is not None:
            reader.finish()
    bar.close()
    return progress


def is_unused_tensor(canonical: str, cfg) -> bool:
    """A tensor no layer of the model reads: see ``_UNUSED``, and layers past the last (DeepSeek's
    and GLM's multi-token-prediction layers are numbered on from the decoder's)."""
    layer = LAYER.match(canonical)
    return bool(_UNUSED.search(canonical)) or (layer is not None and int(layer.group(1)) >= cfg.num_layers)


def _log_skipped(progress: _Progress, architecture: str) -> None:
    """One line for the tensors left out: the known kinds grouped, the strays by name."""
    if not progress.skipped and not progress.stray:
        return
    parts = [skipped_summary(progress.skipped)] if progress.skipped else []
    if progress.stray:
        names = ", ".join(progress.stray[:10]) + (f", … ({len(progress.stray) - 10} more)" if len(progress.stray) > 10
                                                 else "")
        parts.append(f"belonging to no module: {names}")
    log.info("skipped %d tensors %s does not use: %s", len(progress.skipped) + len(progress.stray), architecture,
             "; ".join(parts))


def skipped_summary(names: list[str]) -> str:
    """Skipped tensor names grouped by where they sit: ``mtp.* (12), model.layers.3.* (9)``."""
    groups: dict[str, int] = {}
    for name in names:
        layer, parts = LAYER.match(name), name.split(".")
        key = layer.group(0) if layer else ".".join(parts[: 2 if parts[0] == "model" else 1]) + "."
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(f"{key}* ({n})" for key, n in groups.items())


def _float_tensor(name: str, f) -> None:
    """Refuse a quantized tensor on a path that reads floats (its values would be garbage)."""
    dtype = f.get_slice(name).get_dtype()
    if dtype not in ("F32", "F16", "BF16", "F64"):
        raise CheckpointError(f"tensor '{name}' is stored as {dtype}, and config.json's quantization_config "
                              "(if any) does not make it a quantized weight hearth reads")


def _load_one(name, canonical, f, cfg, params, pool, progress: _Progress, quant=None) -> None:
    try:
        # An empty canonical name: a tensor the family does not use (e.g. multi-token prediction).
        if not canonical or is_unused_tensor(canonical, cfg):
            progress.skipped.append(name)
            return
        if not stage_owns(canonical, cfg):  # another pipeline stage's
            return
        if quant is not None and quant.load(name, canonical, f, params):
            return
        if _load_expert(name, canonical, f, cfg, pool, progress):
            return
        if canonical == "lm_head.weight" and cfg.tie_word_embeddings:
            return  # tied: the embedding is the output projection
        if canonical not in params:
            if not _load_fused_parts(name, canonical, f, params, progress):
                progress.stray.append(name)
            return
        dst = params[canonical]
        if _check_shape(name, tuple(f.get_slice(name).get_shape()), tuple(dst.shape), progress.errors):
            if dst.dtype.is_floating_point:  # (an integer table, e.g. DeepSeek-V4's tid2eid, is read as is)
                _float_tensor(name, f)
            dst.data.copy_(f.get_tensor(name))
            progress.params.discard(canonical)
    except CheckpointError:
        raise
    except Exception as exc:  # a short read inside the data region surfaces here
        raise CheckpointError(f"cannot read tensor '{name}' (truncated or corrupt file?): {exc}") from exc


def _load_fused_parts(name: str, canonical: str, f, params: dict, progress: _Progress) -> bool:
    """A tensor stored fused whose parts the model holds (``_FUSED_PARTS``: a gated MLP's
    ``gate_up_proj`` [2I, H] into ``gate_proj`` and ``up_proj``), its rows split among them in order.
    False where ``canonical`` is no such tensor."""
    for pattern, parts in _FUSED_PARTS:
        match = pattern.match(canonical)
        targets = [f"{match.group(1)}.{part}" for part in parts] if match else []
        if targets and all(t in params for t in targets):
            break
    else:
        return False
    dst = [params[t] for t in targets]
    if _check_shape(name, tuple(f.get_slice(name).get_shape()), (sum(d.shape[0] for d in dst), *dst[0].shape[1:]),
                    progress.errors):
        _float_tensor(name, f)
        for part, rows in zip(dst, f.get_tensor(name).split([d.shape[0] for d in dst]), strict=True):
            part.data.copy_(rows)
        progress.params.difference_update(targets)
    return True


def _report(progress: _Progress) -> None:
    errors = list(progress.errors)
    errors += [f"missing tensor '{p}'" for p in sorted(progress.params)]
    errors += [f"missing tensor 'model.layers.{l}.mlp.experts.{p}'" if p in _BIASED_PARTS else
               f"missing tensor 'model.layers.{l}.mlp.experts.{e}.{p}.weight' (or the fused layout)"
               for l, e, p in sorted(progress.experts) if p not in _BIASED_PARTS or e == 0]
    if errors:
        shown = "\n  ".join(errors[:12])
        more = f"\n  … and {len(errors) - 12} more" if len(errors) > 12 else ""
        raise CheckpointError(f"checkpoint does not match its config:\n  {shown}{more}")


def load_hf_config(model_dir: str | Path, dtype: str | torch.dtype | None = None):
    """Parse a checkpoint directory's config.json into (family, ModelConfig) (an FTW directory's
    too: it keeps its source's config.json)."""
    from transformers import AutoConfig  # deferred: transformers is heavy to import; only configs need it

    model_dir = Path(model_dir)
    raw = read_config_json(model_dir)
    if quant_spec(raw, model_dir) is not None and dtype in (None, "auto"):
        dtype = "float32"  # quantized weights compute in float32 by default, as GGUF files do
    family = family_for(config_architectures(raw))
    try:
        hf = AutoConfig.from_pretrained(str(model_dir))
    except Exception as exc:
        raise ConfigError(f"{model_dir}/config.json: {exc}") from exc
    # A field transformers' config class has a default for is optional (Mixtral's num_experts_per_tok: 2).
    for alternatives in family.required_fields:
        if not any(raw.get(name) is not None or getattr(hf, name, None) is not None for name in alternatives):
            raise ConfigError(f"{model_dir}/config.json lacks the required field '{' or '.join(alternatives)}'")
    try:
        cfg = family.parse_config(hf, model_dir, parse_dtype(raw, dtype))
    except AttributeError as exc:
        raise ConfigError(f"{model_dir}/config.json: missing field ({exc})") from exc
    return family, cfg


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype | None = None, show_progress: bool = False,
    pool_factory: PoolFactory | None = None,
    keep_blocks: bool = True, for_storage: bool = False, layers: tuple[int, int] | None = None,
) -> LoadedModel:
    """Build the model described by ``model_dir`` and fill every weight from its safetensors.

    ``pool_factory(gate_up_shape, down_shape, dtype)`` supplies the expert bank storage (e.g. a
    shared-memory segment); by default the pool is ordinary host memory. ``keep_blocks``: an FP8 or
    MXFP4 checkpoint's quantized weights may stay in their blocks (they do where the native kernels
    run with float32 activations, the default for them; experts not in a ``pool_factory``'s storage;
    ``for_storage``: whether or not the kernels run here, as ``hearth convert`` writes them to FTW)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"model directory '{model_dir}' does not exist")
    family, cfg = load_hf_config(model_dir, dtype)
    if layers is not None:
        cfg = stage_config(cfg, layers)
    quant = quant_spec(read_config_json(model_dir), model_dir)
    keep = quant is not None and keep_blocks and blocks_can_stay(cfg, kernels=not for_storage)
    blocks = expert_blocks(quant, cfg) if keep and pool_factory is None else None
    pool = ExpertPool(cfg, pool_factory(*ExpertPool.bank_shapes(cfg), cfg.dtype) if pool_factory else None, blocks)
    model = build_model(cfg, LocalExpertBackend(pool, cfg.hidden_act))
    progress = _load_tensors(model_dir, cfg, model, pool, family, show_progress, quant, keep)
    _report(progress)
    _log_skipped(progress, cfg.architecture)
    adopt_blocks(model)
    model.eval()
    return LoadedModel(config=cfg, model=model, pool=pool, model_dir=model_dir)
