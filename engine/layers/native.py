"""Decoder layers as one native call per decode step (``engine/kernels/cpu/layer.h``).

A decode step of a few sequences spends most of its time outside the weight kernels when each layer
runs as some forty small torch operations. For the layers whose parts the native layer knows (RMSNorm,
:class:`~hearth.engine.layers.attention.Attention` over the paged KV cache, a softmax top-k
:class:`~hearth.engine.layers.moe.MoEBlock` whose experts are computed from the local pool, with or
without a gated shared expert, or a dense :class:`~hearth.engine.layers.mlp.GatedMLP`), the model hands
the whole layer to one call. Each layer is described once (pointers, sizes, formats) in an int64
tensor; each step adds a small step description. A layer whose feed-forward the native code does not
run (the expert hierarchy's backends, other routers) still gets its attention half natively and runs
its feed-forward module. Anything else (hybrid models' linear attention, gated attention) keeps the
module path, and so does every step that is not a pure decode step of at most 8 tokens.

The native layer rounds each intermediate to the model dtype where the module path does, so results
equal the module path's up to fp32 summation order (``tests/test_native_layers.py``).
``HEARTH_NATIVE_LAYERS=0`` turns it off.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hearth.engine.experts.compute import LocalExpertBackend
from hearth.engine.kernels.cpu import BLOCK_CODES, NativeKernels, cpu_decode_ops
from hearth.engine.layers.attention import Attention, gather_context
from hearth.engine.layers.batch import ForwardBatch
from hearth.engine.layers.mlp import GatedMLP
from hearth.engine.layers.moe import MoEBlock, TopKRouter
from hearth.engine.layers.norm import RMSNorm

_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_TOKENS = 8
_NONE_PROJ = (0, 0, 0, -1, 0)
# LayerDesc of layer.h, field by field (a projection is 5 fields: weight, rows, cols, format, bias).
_PROJ = ("w", "rows", "cols", "fmt", "bias")
LAYER_FIELDS = (
    "dtype", "hidden", "in_norm", "in_eps", "heads", "kv_heads", "head_dim", "window", "scale",
    *(f"{p}.{f}" for p in ("q", "k", "v") for f in _PROJ), "q_norm", "k_norm", "qk_eps",
    *(f"o.{f}" for f in _PROJ), "k_cache", "v_cache", "post_norm", "post_eps", "mlp",
    *(f"router.{f}" for f in _PROJ), "n_experts", "top_k", "normalize", "weights_fp32",
    "gate_up", "gu_stride", "down", "dn_stride", "n_rows", "row_base", "inter", "gu_fmt", "dn_fmt",
    *(f"{p}.{f}" for p in ("gate", "up", "down_proj") for f in _PROJ), "shared_gate", "act_q8", "residual",
)
STEP_FIELDS = ("tokens", "cos", "sin", "rope_width", "slots", "ctx_len", "first_slot", "table", "table_stride",
               "block_size")
_DOUBLES = frozenset({"in_eps", "scale", "qk_eps", "post_eps", "residual"})


def _pack(values: dict[str, int | float], names: tuple[str, ...]) -> torch.Tensor:
    """The fields ``names`` as one int64 tensor (doubles stored by their bits)."""
    words = [struct.unpack("<q", struct.pack("<d", float(values[n])))[0] if n in _DOUBLES else int(values[n])
             for n in names]
    return torch.tensor(words, dtype=torch.int64)


class _Unsupported(Exception):
    """A part of a layer the native layer does not run."""


@dataclass
class _Step:
    desc: torch.Tensor
    batch: ForwardBatch
    keep: tuple[torch.Tensor, ...]  # what the description points into
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)  # scratch the layers of a step share

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A scratch tensor for this step, allocated by the first layer that asks for it."""
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.empty(shape, dtype=dtype)
        return buf


class NativeLayers:
    """The native descriptions of a model's layers for one KV cache (None where a layer keeps its
    modules); see the module docstring."""

    def __init__(self, model, kv, ops: NativeKernels) -> None:
        self.kv = kv
        self._ops = ops
        self._keep: list[torch.Tensor] = []
        self.dtype = model.config.dtype
        # fp32 models run the attention core natively too; in bf16/fp16 it stays torch's SDPA, whose
        # roundings the module path (and transformers) share bit for bit.
        self.native_attention = self.dtype == torch.float32
        cfg = model.config  # a pipeline stage describes its own layers only (the others hold no weights here)
        self.layers: list[tuple[torch.Tensor, bool] | None] = [
            self._describe(layer) if cfg.in_stage(i) else None for i, layer in enumerate(model.model.layers)]
        # Every layer whole and native (fp32): one call runs them all (decode_layers).
        whole = self.native_attention and cfg.layer_range is None and all(d is not None and d[1] for d in self.layers)
        self._all = torch.tensor([d[0].data_ptr() for d in self.layers], dtype=torch.int64) if whole else None
        self._attention = [getattr(layer, "_mixer", None) for layer in model.model.layers]
        self._mlp = [layer.mlp for layer in model.model.layers]

    @staticmethod
    def for_model(model, kv) -> NativeLayers | None:
        """The descriptions, or None where nothing can run natively (no kernels, another device, off)."""
        ops = cpu_decode_ops()
        if ops is None or os.environ.get("HEARTH_NATIVE_LAYERS", "1") == "0" or model.config.dtype not in _DTYPES \
                or not hasattr(ops._decode, "decode_layer"):
            return None
        sizes = ops._decode.layer_desc_size()
        if sizes != (len(LAYER_FIELDS), len(STEP_FIELDS)):
            raise RuntimeError(f"native layer descriptions disagree with the kernels ({sizes})")
        native = NativeLayers(model, kv, ops)
        return native if any(native.layers) else None

    # -- describing a layer ------------------------------------------------------------------
    def _ptr(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        if not (t.is_cpu and t.is_contiguous()):
            raise _Unsupported("a tensor that is not contiguous on the CPU")
        self._keep.append(t)
        return t.data_ptr()

    def _proj(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[int, int, int, int, int]:
        if weight.dtype == torch.uint8:
            fmt = getattr(weight, "block_format", None)
            if fmt is None or fmt.name not in BLOCK_CODES or self.dtype != torch.float32:
                raise _Unsupported("a block format without a kernel")
            cols = weight.shape[1] // fmt.block_bytes * fmt.block_elems
            code = BLOCK_CODES[fmt.name]
            if bias is not None and bias.dtype != torch.float32:
                raise _Unsupported("a bias of another dtype")
        else:
            if weight.dtype != self.dtype:
                raise _Unsupported("a weight of another dtype")
            cols, code = weight.shape[1], -1
            if bias is not None and bias.dtype != self.dtype:
                raise _Unsupported("a bias of another dtype")
        return self._ptr(weight), weight.shape[0], cols, code, self._ptr(bias)

    def _norm(self, norm) -> tuple[int, float]:
        if type(norm) is not RMSNorm or norm.weight.dtype != self.dtype:
            raise _Unsupported("a norm other than RMSNorm")
        return self._ptr(norm.weight), norm.eps

    def _describe(self, layer) -> tuple[torch.Tensor, bool] | None:
        try:
            fields = self._attention_fields(layer)
        except _Unsupported:
            return None
        try:
            fields |= self._mlp_fields(layer.mlp)
        except _Unsupported:
            fields |= self._no_mlp()
        fields["act_q8"] = int(_int8_activations(layer))
        fields["residual"] = float(getattr(layer, "residual_scale", 1.0))
        return _pack(fields, LAYER_FIELDS), fields["mlp"] != 0

    def _attention_fields(self, layer) -> dict[str, int | float]:
        attn = getattr(layer, "_mixer", None)
        if not getattr(layer, "native_order", False):
            raise _Unsupported("a layer in another order than the pre-norm one")
        if type(attn) is not Attention or attn.head_dim > 1024:
            raise _Unsupported("a mixer other than Attention")
        if attn.interleaved_rope or not attn.use_rope or attn.norm_after_rope or attn.rotate_in_fp32 or \
                attn.query_scale is not None or attn.rope_table is not None:
            raise _Unsupported("rotary on interleaved pairs, or none, or q/k norms after it, or a table of its own")
        cache_k, cache_v = self.kv.keys[attn.layer_idx], self.kv.values[attn.layer_idx]
        if cache_k.dtype != self.dtype or not cache_k.is_cpu:
            raise _Unsupported("a KV cache elsewhere")
        f: dict[str, int | float] = {"dtype": _DTYPES[self.dtype], "hidden": layer.input_layernorm.weight.shape[0]}
        f["in_norm"], f["in_eps"] = self._norm(layer.input_layernorm)
        f["post_norm"], f["post_eps"] = self._norm(layer.post_attention_layernorm)
        f |= {"heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": attn.head_dim,
              "window": attn.window or 0, "scale": attn.scale}
        if attn.qkv_weight is not None:
            projs = {"q": self._proj(attn.qkv_weight, attn.qkv_bias), "k": _NONE_PROJ, "v": _NONE_PROJ}
        else:
            projs = {n: self._proj(p.weight, p.bias) for n, p in (("q", attn.q_proj), ("k", attn.k_proj),
                                                                 ("v", attn.v_proj))}
        projs["o"] = self._proj(attn.o_proj.weight, attn.o_proj.bias)
        for name, proj in projs.items():
            f |= dict(zip((f"{name}.{x}" for x in _PROJ), proj, strict=True))
        if attn.q_norm is not None:
            (f["q_norm"], f["qk_eps"]), (f["k_norm"], _) = self._norm(attn.q_norm), self._norm(attn.k_norm)
        else:
            f["q_norm"], f["k_norm"], f["qk_eps"] = 0, 0, 0.0
        f["k_cache"], f["v_cache"] = self._ptr(cache_k), self._ptr(cache_v)
        return f

    def _no_mlp(self) -> dict[str, int | float]:
        f: dict[str, int | float] = dict.fromkeys(("mlp", "n_experts", "top_k", "normalize", "weights_fp32", "gate_up",
                                                   "gu_stride", "down", "dn_stride", "n_rows", "row_base", "inter",
                                                   "shared_gate"), 0)
        f["gu_fmt"] = f["dn_fmt"] = -1
        for name in ("router", "gate", "up", "down_proj"):
            f |= dict(zip((f"{name}.{x}" for x in _PROJ), _NONE_PROJ, strict=True))
        return f

    def _gated_mlp(self, mlp) -> dict[str, int | float]:
        if type(mlp) is not GatedMLP or mlp.act is not F.silu:
            raise _Unsupported("a feed-forward other than a SiLU gated MLP")
        f: dict[str, int | float] = {}
        for name, proj in (("gate", mlp.gate_proj), ("up", mlp.up_proj), ("down_proj", mlp.down_proj)):
            f |= dict(zip((f"{name}.{x}" for x in _PROJ), self._proj(proj.weight, proj.bias), strict=True))
        return f

    def _mlp_fields(self, mlp) -> dict[str, int | float]:
        f = self._no_mlp()
        if type(mlp) is GatedMLP:
            return f | self._gated_mlp(mlp) | {"mlp": 2}
        if type(mlp) is not MoEBlock or type(mlp.gate) is not TopKRouter or type(mlp.backend) is not LocalExpertBackend:
            raise _Unsupported("a feed-forward other than a local softmax top-k MoE block")
        if mlp.backend.act is not F.silu or mlp.routed_scale != 1.0 or mlp.shared_average:
            raise _Unsupported("a feed-forward other than a local softmax top-k MoE block")
        pool, router = mlp.backend.pool, mlp.gate
        blocks = pool.layer_blocks(mlp.layer_idx)
        if blocks is not None and self.dtype != torch.float32:
            raise _Unsupported("block experts need fp32 activations")
        f |= dict(zip((f"router.{x}" for x in _PROJ), self._proj(router.weight), strict=True))
        f |= {"mlp": 1, "n_experts": router.weight.shape[0], "top_k": router.top_k, "normalize": int(router.normalize),
              "weights_fp32": int(router.weights_in_fp32), "n_rows": pool.gate_up.shape[0],
              "row_base": pool.layer_rows(mlp.layer_idx), "inter": pool.gate_up.shape[1] // 2 if blocks is None
              else blocks.inter}
        if blocks is None:
            if pool.gate_up.dtype != self.dtype:
                raise _Unsupported("expert banks of another dtype")
        elif blocks.gate_up.name not in BLOCK_CODES or blocks.down.name not in BLOCK_CODES:
            raise _Unsupported("expert formats without a kernel")
        else:
            f["gu_fmt"], f["dn_fmt"] = BLOCK_CODES[blocks.gate_up.name], BLOCK_CODES[blocks.down.name]
        f["gate_up"], f["down"] = self._ptr(pool.gate_up), self._ptr(pool.down)
        f["gu_stride"], f["dn_stride"] = pool.gate_up.stride(0), pool.down.stride(0)
        if mlp.shared_expert is not None:
            f |= self._gated_mlp(mlp.shared_expert)
            if mlp.shared_expert_gate is not None:
                if mlp.shared_expert_gate.weight.dtype != self.dtype:
                    raise _Unsupported("a shared expert gate of another dtype")
                f["shared_gate"] = self._ptr(mlp.shared_expert_gate.weight)
        return f

    # -- running ------------------------------------------------------------------------------
    def step(self, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor]) -> _Step | None:
        """The step description, or None when the step is not a pure decode step of at most 8 tokens."""
        seqs = batch.sequences
        if not 0 < len(seqs) <= MAX_TOKENS or len(seqs) != batch.num_tokens or any(s.query_len != 1 for s in seqs):
            return None
        cos, sin = (t.contiguous() for t in rope)
        if cos.dtype != self.dtype:
            return None
        ctx = torch.tensor([s.context_len for s in seqs], dtype=torch.int64)
        first = torch.tensor([s.first_block * batch.block_size if s.first_block >= 0 else -1 for s in seqs],
                             dtype=torch.int64)
        if all(s.first_block >= 0 for s in seqs):
            table, stride = torch.zeros(1, dtype=torch.int64), 0
        else:
            stride = max(len(s.block_ids) for s in seqs)
            table = torch.zeros((len(seqs), stride), dtype=torch.int64)
            for i, s in enumerate(seqs):
                table[i, : len(s.block_ids)] = s.block_ids
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        keep = (cos, sin, ctx, first, table, slots)
        values = {"tokens": len(seqs), "cos": cos.data_ptr(), "sin": sin.data_ptr(), "rope_width": cos.shape[-1],
                  "slots": slots.data_ptr(), "ctx_len": ctx.data_ptr(), "first_slot": first.data_ptr(),
                  "table": table.data_ptr(), "table_stride": stride, "block_size": batch.block_size}
        return _Step(_pack(values, STEP_FIELDS), batch, keep)

    def run_all(self, h: torch.Tensor, step: _Step) -> bool:
        """Every layer's decode step on ``h`` [T, H] in place, in one native call: True when the model
        runs whole natively, else False (nothing ran; the caller goes layer by layer with :meth:`run`)."""
        if self._all is None:
            return False
        rc = self._ops._decode.decode_layers(self._all.data_ptr(), len(self.layers), step.desc.data_ptr(),
                                             h.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"decode_layers failed ({rc})")
        return True

    def run(self, index: int, h: torch.Tensor, step: _Step) -> bool | None:
        """Layer ``index``'s decode step on ``h`` [T, H] in place: True when it ran whole, False when
        only its attention half ran (the caller runs the feed-forward), None when it did not run."""
        described = self.layers[index]
        if described is None:
            return None
        desc, whole = described
        call, threads = self._ops._decode.decode_layer, torch.get_num_threads()
        d, st = desc.data_ptr(), step.desc.data_ptr()
        if self.native_attention:
            rc = call(0, d, st, h.data_ptr(), 0, 0, 0, 0, threads)
        else:  # torch's SDPA and router between the native parts (see __init__)
            rc = self._exact_parts(index, h, step, call, d, st, threads)
        if rc != 0:
            raise RuntimeError(f"decode_layer failed ({rc})")
        return whole

    def _exact_parts(self, index: int, h: torch.Tensor, step: _Step, call, d: int, st: int, threads: int) -> int:
        """A bf16/fp16 layer: the native parts around torch's attention core and softmax top-k, whose
        roundings the module path shares bit for bit; the attention-only form stops after the output
        projection's residual (the caller runs the feed-forward module from h)."""
        attn, mlp = self._attention[index], self._mlp[index]
        q = step.buffer("q", (h.shape[0], attn.num_heads, attn.head_dim), h.dtype)
        xn = step.buffer("xn", h.shape, h.dtype)
        rc = call(1, d, st, h.data_ptr(), q.data_ptr(), 0, 0, 0, threads)
        out = _decode_attention(attn, q, step.batch, self.kv.keys[attn.layer_idx], self.kv.values[attn.layer_idx])
        moe = isinstance(mlp, MoEBlock)
        logits = step.buffer("logits", (h.shape[0], mlp.gate.weight.shape[0]), h.dtype) if moe else xn
        rc = rc or call(2, d, st, h.data_ptr(), out.data_ptr(), xn.data_ptr(), logits.data_ptr(), 0, threads)
        if rc or self.layers[index][1] is False:
            return rc
        if not moe:
            return call(3, d, st, h.data_ptr(), 0, xn.data_ptr(), 0, 0, threads)
        ids, weights = mlp.gate.select(logits)
        return call(3, d, st, h.data_ptr(), ids.data_ptr(), xn.data_ptr(), weights.data_ptr(), _DTYPES[weights.dtype],
                    threads)


def _int8_activations(layer) -> bool:
    """Whether the layer's weights run in the int8-activation mode (engine/kernels/cpu/int8_mode.py)."""
    mlp = layer.mlp
    if isinstance(mlp, MoEBlock) and type(mlp.backend) is LocalExpertBackend:
        blocks = mlp.backend.pool.layer_blocks(mlp.layer_idx)
        if blocks is not None and blocks.int8_activations:
            return True
    # The fused q/k/v weight's views (q/k/v_proj) are parameters, marked as it is.
    return any(getattr(t, "int8_activations", False) for t in layer.parameters())


def _decode_attention(attn: Attention, q: torch.Tensor, batch: ForwardBatch, keys: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
    """The attention core of a decode step through the module's own torch path: one lone sequence
    without a window in play goes straight to its single-query call (no output copy or mask lookup)."""
    seq = batch.sequences[0]
    if len(batch.sequences) == 1 and (attn.window is None or seq.context_len <= attn.window):
        return attn._decode_one(q, gather_context(keys, seq, batch.block_size),
                                gather_context(values, seq, batch.block_size))
    return attn.attend(q, batch, keys, values)
