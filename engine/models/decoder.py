"""The decoder every family is assembled into: residual blocks of a token mixer and a feed-forward,
each part chosen and built by the family file.

Parameter names follow the transformers in-memory layout (``model.layers.N.self_attn.q_proj.weight``),
so a family's checkpoint-name mapping only has to handle what differs from it.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from hearth.engine.cache.kv_pages import PagedKVCache
from hearth.engine.cache.state_slots import RecurrentStatePool
from hearth.engine.config import ModelConfig
from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.batch import ForwardBatch, LayerContext, StaticBatch
from hearth.engine.layers.linear import Projection, TokenEmbedding
from hearth.engine.layers.moe import MoEBlock
from hearth.engine.layers.native import NativeLayers
from hearth.engine.layers.rope import RotaryEmbedding
from hearth.engine.ops import linear


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``h + mixer(norm(h))``, then ``h + mlp(norm(h))``. The mixer (attention,
    or a hybrid's gated DeltaNet) is registered under its checkpoint name (``self_attn``,
    ``linear_attn``); mixer and mlp are called with the forward pass's :class:`LayerContext`.
    ``residual_scale`` multiplies each branch before its residual add (Granite's ``residual_multiplier``).
    A subclass that computes another order sets ``native_order`` False: the native decode layer
    (layers/native.py) computes this one only."""

    native_order = True

    def __init__(self, mixer: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module, residual_scale: float = 1.0) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.add_module(mixer.checkpoint_name, mixer)
        object.__setattr__(self, "_mixer", mixer)  # the same module, not registered twice
        self.post_attention_layernorm = post_attention_layernorm
        self.mlp = mlp
        self.residual_scale = residual_scale

    def forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        h = self.add_branch(h, self._mixer(self.input_layernorm(h), ctx))
        return self.feed_forward(h, ctx)

    def feed_forward(self, h: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """The second half: ``h`` plus the feed-forward of its norm."""
        return self.add_branch(h, self.mlp(self.post_attention_layernorm(h), ctx))

    def add_branch(self, h: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """The residual add, the branch scaled first where the family scales it (in the model dtype, as
        transformers rounds it)."""
        return h + branch if self.residual_scale == 1.0 else h + branch * self.residual_scale


class DecoderModel(nn.Module):
    """Embeddings, decoder layers and final norm (the ``model.`` prefix of checkpoints)."""

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], norm: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = TokenEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.dtype)  # the loader fills it
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary = RotaryEmbedding(cfg)
        self.layer_rotary = nn.ModuleList(self._layer_tables(cfg))

    def _layer_tables(self, cfg: ModelConfig) -> list[RotaryEmbedding]:
        """The rotary tables of layers that turn by their own (``cfg.layer_ropes``), one per distinct
        set of parameters; each such layer's attention is told its table's index (``rope_table``)."""
        distinct: list = []
        for index, rope in enumerate(cfg.layer_ropes):
            if rope is None or rope == cfg.rope:
                continue
            if rope not in distinct:
                distinct.append(rope)
            self.layers[index]._mixer.rope_table = distinct.index(rope)
        return [RotaryEmbedding(replace(cfg, rope=rope)) for rope in distinct]

    def context(self, batch, kv: PagedKVCache, states: RecurrentStatePool | None, dtype: torch.dtype) -> LayerContext:
        """The forward pass's :class:`LayerContext`: the rotary tables of the batch's positions in ``dtype``."""
        positions = batch.positions
        return LayerContext(batch, kv, states, self.rotary(positions, dtype),
                            ropes=tuple(table(positions, dtype) for table in self.layer_rotary))


class MoECausalLM(nn.Module):
    """A decoder-only MoE language model over a flattened batch and a paged KV cache. ``embedding_scale``
    multiplies the token embeddings and ``logits_divisor`` divides the logits (Granite's
    ``embedding_multiplier`` and ``logits_scaling``; 1 elsewhere); ``logits_scale`` multiplies them
    (Cohere's ``logit_scale``); ``lm_head_bias`` gives the output head a bias (Phi-3.5-MoE's)."""

    def __init__(self, cfg: ModelConfig, layers: list[DecoderLayer], norm: nn.Module, *,
                 embedding_scale: float = 1.0, logits_divisor: float = 1.0, logits_scale: float = 1.0,
                 lm_head_bias: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.embedding_scale, self.logits_divisor, self.logits_scale = embedding_scale, logits_divisor, logits_scale
        self.model = DecoderModel(cfg, layers, norm)
        self.lm_head = Projection(cfg.hidden_size, cfg.vocab_size, lm_head_bias, cfg.dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.requires_grad_(False)
        self._native: tuple[object, NativeLayers | None] | None = None  # (KV cache, its native layers)

    def set_expert_backend(self, backend: ExpertBackend) -> None:
        """Route every MoE layer's experts through ``backend`` (e.g. the expert hierarchy)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.backend = backend
        self._native = None

    def native_layers(self, kv: PagedKVCache) -> NativeLayers | None:
        """The layers' native decode descriptions for ``kv`` (built on first use; see layers/native.py)."""
        if self._native is None or self._native[0] is not kv:
            self._native = (kv, NativeLayers.for_model(self, kv))
        return self._native[1]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch | StaticBatch, kv: PagedKVCache,
                states: RecurrentStatePool | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] in fp32. Hybrid models also need ``states``
        (each sequence's slot named in the batch). A :class:`StaticBatch` (a fixed-shape decode step,
        ``engine/executor/fixed_shape.py``) goes through the modules, never the native layer calls.

        A pipeline stage (``config.layer_range``) runs only its layers: from ``hidden`` [T, H] (the
        previous stage's output) unless it is the first, and it returns its hidden states [T, H]
        unless it is the last."""
        if self.config.linear_layer_ids and states is None:
            raise ValueError(f"{self.config.architecture} has linear-attention layers: forward needs a state pool")
        if self.config.layer_range is not None:
            return self._forward_stage(batch, kv, states, hidden)
        h = self._embed(batch.token_ids)  # [T, H]
        ctx = self.model.context(batch, kv, states, torch.float32 if self.config.rope_in_fp32 else h.dtype)
        native = self.native_layers(kv) if h.is_cpu and not isinstance(batch, StaticBatch) else None
        step = native.step(batch, ctx.rope) if native is not None else None
        if step is None or not native.run_all(h, step):  # layer by layer, natively where each can
            h = self._run_layers(h, ctx, range(len(self.model.layers)), native, step)
        h = self.model.norm(h.index_select(0, batch.logits_indices))
        return self._logits(h)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(token_ids)
        return h if self.embedding_scale == 1.0 else h * self.embedding_scale

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final hidden states, scaled in the model dtype where the family scales them."""
        logits = linear(h, self.lm_head.weight, self.lm_head.bias)
        if self.logits_scale != 1.0:
            logits = logits * self.logits_scale
        return (logits if self.logits_divisor == 1.0 else logits / self.logits_divisor).float()

    def _run_layers(self, h: torch.Tensor, ctx: LayerContext, indices: range, native: NativeLayers | None,
                    step) -> torch.Tensor:
        """Layers ``indices`` over ``h`` [T, H]: each natively where it can (in place), else its modules."""
        for index in indices:
            layer = self.model.layers[index]
            ran = native.run(index, h, step) if step is not None else None
            if ran is None:
                h = layer(h, ctx)
            elif not ran:  # attention ran natively; the feed-forward is the module's
                h = layer.feed_forward(h, ctx)
        return h

    def _forward_stage(self, batch: ForwardBatch, kv: PagedKVCache, states: RecurrentStatePool | None,
                       hidden: torch.Tensor | None) -> torch.Tensor:
        """The layers of one pipeline stage, natively where they can be (see :meth:`forward`)."""
        first, end = self.config.layer_range
        if first > 0 and hidden is None:
            raise ValueError(f"pipeline stage [{first}, {end}) needs the previous stage's hidden states")
        # The native layers work in place: never on the caller's tensor (another stage's, or Ray's buffer).
        h = self._embed(batch.token_ids) if first == 0 else hidden.clone()  # [T, H]
        ctx = self.model.context(batch, kv, states, torch.float32 if self.config.rope_in_fp32 else h.dtype)
        native = self.native_layers(kv) if h.is_cpu and isinstance(batch, ForwardBatch) else None
        step = native.step(batch, ctx.rope) if native is not None else None
        h = self._run_layers(h, ctx, range(first, end), native, step)
        if end < self.config.num_layers:
            return h
        h = self.model.norm(h.index_select(0, batch.logits_indices))
        return self._logits(h)

