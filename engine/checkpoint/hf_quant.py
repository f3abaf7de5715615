"""Hugging Face checkpoints quantized as shipped: FP8 e4m3 with block scales (``quant_method: fp8``,
DeepSeek-V3 and Qwen3-…-FP8 style) and MXFP4 experts (``quant_method: mxfp4``, GPT-OSS style).

Their quantized tensors are repacked at load into block formats the kernels read, without being
dequantized (see :mod:`hearth.engine.quant.formats` and docs/quantization.md):

- **FP8.** A quantized Linear's ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` fp32
  [ceil(N / bn), ceil(K / bk)] (``weight_block_size`` [bn, bk]) become hearth's ``fp8_e4m3`` rows:
  each 128 elements of a row carry the scale of the tile they lie in, then their 128 bytes as they
  are. Per-expert tensors (``mlp.experts.{e}.{gate,up,down}_proj.weight``) and fused ones
  (``mlp.experts.gate_up_proj`` [E, 2I, H] with ``gate_up_proj_scale_inv``) go to the pool; dense
  projections held by a :class:`~hearth.engine.layers.linear.Projection` (attention's q/k/v/o,
  shared experts, the output projection) become block weights.
- **MXFP4.** Fused expert tensors ``mlp.experts.{gate_up,down}_proj_blocks`` uint8 [E, R, K / 32, 16]
  (two E2M1 values a byte, the low nibble the even element, as transformers'
  ``convert_moe_packed_tensors`` reads them) and ``…_scales`` uint8 [E, R, K / 32] (E8M0) become
  GGML's ``mxfp4`` rows (the exponent byte, then elements 0–15 in the low nibbles and 16–31 in the
  high ones): a nibble shuffle. The rows R are the outputs; gate rows then up rows for Qwen3-MoE
  and Mixtral (GPT-OSS interleaves them: a row permutation at load, the blocks unchanged).

Where blocks cannot stay (another compute dtype than float32, no native kernels, a shared-memory
pool), the repacked rows are decoded with :func:`~hearth.engine.quant.registry.dequantize`, which
gives the values transformers' dequantization gives in fp32. Every check here is a one-line
:class:`~hearth.engine.config.ConfigError` (config.json) or ``CheckpointError`` (a tensor).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hearth.engine import hugepages
from hearth.engine.checkpoint.common import FUSED, PER_EXPERT, CheckpointError, replace_parameter
from hearth.engine.config import ConfigError
from hearth.engine.experts.pool import ExpertBlocks, ExpertPool
from hearth.engine.layers.linear import Projection, TokenEmbedding
from hearth.engine.ops import block_weight, deinterleave
from hearth.engine.quant.block import BlockFormat
from hearth.engine.quant.registry import FORMATS, HEARTH_FORMATS, dequantize

FP8_BLOCK = HEARTH_FORMATS["fp8_e4m3"]
MXFP4_BLOCK = FORMATS["mxfp4"]
METHODS = ("fp8", "mxfp4")
# safetensors dtypes of FP8 scale tensors, all widened to fp32 exactly (E8M0: "scale_fmt": "ue8m0").
_FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")
_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's ``quantization_config`` says, checked: the method, and FP8's tile shape."""

    method: str  # "fp8" or "mxfp4"
    source: str  # the config file, for messages
    tile: tuple[int, int] = (128, 128)  # FP8 weight_block_size: rows, columns per scale

    @property
    def format(self) -> BlockFormat:
        return FP8_BLOCK if self.method == "fp8" else MXFP4_BLOCK

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.method == "fp8" else "_scales"


def quant_spec(raw: dict[str, Any], model_dir: str | Path) -> QuantSpec | None:
    """The checked ``quantization_config`` of a config.json (None when there is none), at its top or
    under ``text_config`` (a multimodal checkpoint's language model: Kimi-K2.5's)."""
    text = raw.get("text_config")
    qc = raw.get("quantization_config") or (text.get("quantization_config") if isinstance(text, dict) else None)
    if qc is None:
        return None
    source = f"{model_dir}/config.json"
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config is not an object")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ConfigError(f"{source}: quantization_config quant_method '{method}' is not supported "
                          f"({' and '.join(METHODS)} checkpoints load as shipped)")
    if method == "mxfp4":
        return QuantSpec("mxfp4", source)
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{source}: quantization_config fmt '{fmt}' is not supported (FP8 weights load in e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{source}: quantization_config activation_scheme '{scheme}' is not supported (only "
                          "'dynamic': hearth keeps activations in fp32 and has no use for static input scales)")
    tile = qc.get("weight_block_size")
    if tile is None:
        raise ConfigError(f"{source}: FP8 without weight_block_size (one scale per tensor) is not supported; "
                          "block-scaled checkpoints (weight_block_size [128, 128]) are")
    if not (isinstance(tile, list | tuple) and len(tile) == 2 and all(isinstance(t, int) and t > 0 for t in tile)):
        raise ConfigError(f"{source}: quantization_config weight_block_size {tile} is not two positive integers")
    if tile[1] % FP8_BLOCK.block_elems:
        raise ConfigError(f"{source}: quantization_config weight_block_size {list(tile)}: tiles {tile[1]} columns "
                          f"wide are not whole {FP8_BLOCK.block_elems}-element blocks (hearth's FP8 blocks are "
                          f"{FP8_BLOCK.block_elems} elements of a row under one scale)")
    return QuantSpec("fp8", source, (int(tile[0]), int(tile[1])))


def expert_blocks(spec: QuantSpec, cfg) -> dict[int, ExpertBlocks] | None:
    """Every MoE layer's experts in the checkpoint's format (gate, up and down alike); None when the
    experts' rows are not whole blocks (quantized expert tensors are then refused, naming them)."""
    if cfg.hidden_size % spec.format.block_elems or cfg.moe_intermediate_size % spec.format.block_elems:
        return None
    return {layer: ExpertBlocks(spec.format, spec.format, cfg.hidden_size, cfg.moe_intermediate_size,
                                bias=cfg.expert_bias) for layer in cfg.moe_layer_ids}


def fp8_rows(weight: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn ``weight`` [..., N, K] with fp32 tile scales [..., ceil(N / bn), ceil(K / bk)] ->
    ``fp8_e4m3`` rows uint8 [..., N, K / 128 · 132] (K a multiple of 128, bk of 128; checked by
    the caller). The bytes are copied, the scales repeated: nothing is rounded."""
    *lead, n, k = weight.shape
    bn, bk = tile
    per = FP8_BLOCK.block_elems
    s = scale.to(torch.float32).repeat_interleave(bn, -2)[..., :n, :]  # [..., N, tiles across]
    s = s.repeat_interleave(bk // per, -1)[..., : k // per].contiguous()  # [..., N, K / 128]
    out = hugepages.empty(*lead, n, k // per, FP8_BLOCK.block_bytes, dtype=torch.uint8)
    out[..., :4] = s.view(torch.uint8).reshape(*lead, n, k // per, 4)
    out[..., 4:] = weight.contiguous().view(torch.uint8).reshape(*lead, n, k // per, per)
    return out.reshape(*lead, n, -1)


def mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks`` uint8 [..., R, G, 16] (byte j: element 2j low, 2j + 1 high) and E8M0
    ``scales`` uint8 [..., R, G] -> GGML ``mxfp4`` rows uint8 [..., R, G · 17] (byte j: element j low,
    j + 16 high): the same nibbles and exponents, reordered."""
    nibbles = torch.stack([blocks & 0x0F, blocks >> 4], -1).reshape(*blocks.shape[:-1], 32)  # element order
    packed = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    return torch.cat([scales.unsqueeze(-1), packed], -1).reshape(*scales.shape[:-1], -1)


@dataclass
class QuantLoader:
    """Reads a quantized checkpoint's quantized tensors for :func:`hearth.engine.checkpoint.hf.load_model`:
    ``load`` takes a tensor (True when it was one of them), ``finish`` reports scales nothing used.
    Mismatches the plain loader reports too (shapes, unexpected names) go to ``progress.errors``;
    what only quantized tensors can get wrong raises at once, one line naming the file and tensor."""

    spec: QuantSpec
    files: dict[str, Path]  # tensor name -> shard
    handle: Any  # shard path -> its open safetensors handle
    cfg: Any
    model: torch.nn.Module
    pool: ExpertPool
    keep_dense: bool  # dense projections may stay in blocks
    progress: Any  # hf's _Progress (which tensors are still missing)
    scales_seen: set[str] = field(default_factory=set)
    scales_used: set[str] = field(default_factory=set)

    def load(self, name: str, canonical: str, f, params: dict[str, torch.nn.Parameter]) -> bool:
        if name.endswith(self.spec.scale_suffix):
            self.scales_seen.add(name)  # read with its weight
            return True
        if self.spec.method == "fp8":
            if f.get_slice(name).get_dtype() != "F8_E4M3":
                return False  # a float tensor (norms, router, embeddings…): the plain path
            return self._fp8(name, canonical, f, params)
        if not name.endswith("_blocks"):
            return False
        return self._mxfp4(name, canonical[: -len("_blocks")], f)

    def finish(self) -> None:
        self.progress.errors += [f"unexpected tensor '{n}' (a scale with no quantized weight)"
                                 for n in sorted(self.scales_seen - self.scales_used)]

    # -- FP8 ------------------------------------------------------------------------------------------

    def _fp8(self, name: str, canonical: str, f, params: dict[str, torch.nn.Parameter]) -> bool:
        errors = self.progress.errors
        shape = tuple(f.get_slice(name).get_shape())
        i, h, e = self.cfg.moe_intermediate_size, self.cfg.hidden_size, self.cfg.num_experts
        per, fused = PER_EXPERT.match(canonical), FUSED.match(canonical)
        if per is not None or fused is not None:
            layer = int((per or fused).group(1))
            if layer >= self.cfg.num_layers or not self.cfg.moe_layers[layer]:
                errors.append(f"unexpected tensor '{name}': layer {layer} has no experts")
                return True
            if per is not None:
                expert, part = int(per.group(2)), per.group(3)
                if expert >= e:
                    errors.append(f"unexpected tensor '{name}': expert {expert} >= num_experts {e}")
                    return True
                want = (h, i) if part == "down_proj" else (i, h)
            else:
                part = fused.group(2)
                want = (e, 2 * i, h) if part == "gate_up_proj" else (e, h, i)
            if shape != want:
                errors.append(f"tensor '{name}' has shape {list(shape)}, expected {list(want)}")
                return True
            rows = self._fp8_tensor(name, shape, f)
            if per is not None:
                self._put_experts(layer, range(expert, expert + 1), part, rows.unsqueeze(0))
            else:
                self._put_experts(layer, range(e), part, rows)
            return True
        if canonical not in params:
            self.progress.stray.append(name)  # belongs to no module: skipped, as transformers does
            return True
        param = params[canonical]
        if shape != tuple(param.shape):
            errors.append(f"tensor '{name}' has shape {list(shape)}, expected {list(param.shape)}")
            return True
        rows = self._fp8_tensor(name, shape, f)
        owner = self.model.get_submodule(canonical.rsplit(".", 1)[0])
        if self.keep_dense and len(shape) == 2 and _takes_blocks(owner):
            replace_parameter(self.model, param, block_weight(rows, FP8_BLOCK))
        else:
            param.data.copy_(dequantize(rows.reshape(-1, rows.shape[-1]), FP8_BLOCK, shape[-1]).reshape(shape))
        self.progress.params.discard(canonical)
        return True

    def _fp8_tensor(self, name: str, shape: tuple[int, ...], f) -> torch.Tensor:
        """A checked FP8 weight and its scale tensor as ``fp8_e4m3`` rows [..., N, row bytes]."""
        bn, bk = self.spec.tile
        *lead, n, k = shape
        where = self.files[name]
        if k % FP8_BLOCK.block_elems:
            raise CheckpointError(f"{where}: tensor '{name}' {list(shape)}: rows of {k} elements are not whole "
                                  f"{FP8_BLOCK.block_elems}-element blocks (weight_block_size {list(self.spec.tile)})")
        scale_name = name + "_scale_inv"
        if scale_name not in self.files:
            raise CheckpointError(f"{where}: FP8 tensor '{name}' has no scale tensor '{scale_name}'")
        scale_file = self.files[scale_name]
        sl = self.handle(scale_file).get_slice(scale_name)
        want = (*lead, -(-n // bn), -(-k // bk))
        if tuple(sl.get_shape()) != want:
            raise CheckpointError(f"{scale_file}: scale tensor '{scale_name}' has shape {list(sl.get_shape())}, "
                                  f"expected {list(want)} for weight {list(shape)} in {bn}x{bk} tiles "
                                  "(weight_block_size)")
        if sl.get_dtype() not in _FP8_SCALE_DTYPES:
            raise CheckpointError(f"{scale_file}: scale tensor '{scale_name}' is {sl.get_dtype()}, not a float type "
                                  f"({', '.join(_FP8_SCALE_DTYPES)})")
        self.scales_used.add(scale_name)
        return fp8_rows(f.get_tensor(name), sl[:], self.spec.tile)

    # -- MXFP4 ----------------------------------------------------------------------------------------

    def _mxfp4(self, name: str, canonical: str, f) -> bool:
        where = self.files[name]
        fused = FUSED.match(canonical)
        if fused is None:
            raise CheckpointError(f"{where}: MXFP4 tensor '{name}' is not a fused expert tensor (mlp.experts."
                                  "gate_up_proj_blocks or down_proj_blocks): only experts are read in MXFP4")
        layer, part = int(fused.group(1)), fused.group(2)
        if layer >= self.cfg.num_layers or not self.cfg.moe_layers[layer]:
            self.progress.errors.append(f"unexpected tensor '{name}': layer {layer} has no experts")
            return True
        i, h, e = self.cfg.moe_intermediate_size, self.cfg.hidden_size, self.cfg.num_experts
        rows, cols = (2 * i, h) if part == "gate_up_proj" else (h, i)
        per = MXFP4_BLOCK.block_elems
        if cols % per:
            raise CheckpointError(f"{where}: tensor '{name}': rows of {cols} elements are not whole {per}-element "
                                  "MXFP4 blocks")
        sl = f.get_slice(name)
        want = (e, rows, cols // per, per // 2)
        if tuple(sl.get_shape()) != want or sl.get_dtype() != "U8":
            raise CheckpointError(f"{where}: tensor '{name}' is {sl.get_dtype()} {list(sl.get_shape())}, expected "
                                  f"U8 {list(want)} (experts, rows, {per}-element blocks, 16 bytes)")
        scale_name = name[: -len("_blocks")] + "_scales"
        if scale_name not in self.files:
            raise CheckpointError(f"{where}: MXFP4 tensor '{name}' has no scale tensor '{scale_name}'")
        ss = self.handle(self.files[scale_name]).get_slice(scale_name)
        if tuple(ss.get_shape()) != want[:3] or ss.get_dtype() != "U8":
            raise CheckpointError(f"{self.files[scale_name]}: scale tensor '{scale_name}' is {ss.get_dtype()} "
                                  f"{list(ss.get_shape())}, expected U8 {list(want[:3])} (one E8M0 byte per block)")
        self.scales_used.add(scale_name)
        for expert in range(e):  # one expert at a time: the shuffle's temporaries stay small
            packed = mxfp4_rows(sl[expert : expert + 1], ss[expert : expert + 1])
            self._put_experts(layer, range(expert, expert + 1), part, packed)
        return True

    # -- the pool -------------------------------------------------------------------------------------

    def _put_experts(self, layer: int, experts: range, part: str, rows: torch.Tensor) -> None:
        """Experts ``experts`` of ``layer``: ``rows`` [n, R, row bytes] of ``part`` (gate_proj, up_proj,
        down_proj, or gate_up_proj: gate rows then up rows) into the pool, in blocks or decoded."""
        pool, i, fmt = self.pool, self.cfg.moe_intermediate_size, self.spec.format
        base = pool.layer_rows(layer)
        bank_rows = slice(base + experts.start, base + experts.stop)
        bank = pool.down if part == "down_proj" else pool.gate_up
        first = i if part == "up_proj" else 0  # up rows follow the gate rows
        if self.cfg.expert_bias and part == "gate_up_proj":  # GPT-OSS interleaves gate and up rows
            rows = deinterleave(rows, dim=1)
        n, r, width = rows.shape
        if pool.layer_blocks(layer) is not None:  # each expert's rows of blocks at the start of its bank row
            bank[bank_rows, first * width : (first + r) * width].copy_(rows.reshape(n, -1))
        else:
            cols = width // fmt.block_bytes * fmt.block_elems
            values = dequantize(rows.reshape(n * r, width), fmt, cols).reshape(n, r, cols)
            bank[bank_rows, first : first + r, :cols].copy_(values)  # (a bias column may follow)
        for e in experts:
            for p in (part,) if self.cfg.expert_bias else _EXPERT_PARTS.get(part, (part,)):
                self.progress.experts.discard((layer, e, p))


def _takes_blocks(module: torch.nn.Module) -> bool:
    """Whether a module computes from its weight through :func:`~hearth.engine.ops.linear` (or
    gathers rows of it), which read block weights."""
    return isinstance(module, Projection | TokenEmbedding)
