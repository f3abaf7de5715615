"""Gated DeltaNet: the linear-attention layers of hybrid models (Qwen3-Next, Qwen3.5).

Each sequence carries two pieces of state per layer, kept in a pool outside the layer (one slot per
running sequence): the last ``K - 1`` inputs of the short causal convolution, and the recurrent
state ``S`` [heads, Dk, Dv] (fp32) of the gated delta rule. Per token t:

    S <- exp(g_t) * S                  (decay)
    u_t = beta_t * (v_t - S^T k_t)      (the part of v_t that S does not already predict)
    S <- S + k_t u_t^T                  (delta-rule write)
    o_t = S^T q_t

Decode steps apply this recurrence directly. Prefill chunks use the equivalent chunked form: within
a chunk of C tokens the writes u solve one unit lower-triangular system, and the state is touched
once per chunk. A step may also snapshot the state part-way through a sequence (the prefix cache's
checkpoints): the sequence is then computed in segments cut at those offsets.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.config import LinearAttentionConfig
from hearth.engine.layers.batch import LayerContext, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.norm import GatedRMSNorm
from hearth.engine.ops import linear

CHUNK = 64


class _Weight(nn.Module):
    """A bare ``weight`` parameter under a checkpoint name (``conv1d.weight``)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(q, k, v, g, beta, state):
    """One token for B sequences at once. q, k: [B, H, Dk]; v: [B, H, Dv]; g: [B, H] (one decay per
    head) or [B, H, Dk] (one per key channel: Kimi's delta attention); beta: [B, H]; state:
    [B, H, Dk, Dv] (all fp32). Returns (o [B, H, Dv], new state)."""
    state = state * (g.exp()[..., None, None] if g.dim() == beta.dim() else g.exp()[..., None])
    predicted = (state * k[..., None]).sum(dim=-2)  # S^T k: [B, H, Dv]
    update = (v - predicted) * beta[..., None]
    state = state + k[..., None] * update[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def chunked_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The gated delta rule over one sequence segment, chunk by chunk.

    q, k: [n, H, Dk]; v: [n, H, Dv]; g, beta: [n, H]; state: [H, Dk, Dv] (all fp32; q already
    scaled). Returns (o [n, H, Dv], final state)."""
    n = q.shape[0]
    pad = (-n) % chunk  # zero padding: g = 0 keeps the state, beta = k = 0 writes nothing
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, n + pad, D]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, n + pad]
    heads, total = g.shape
    q, k, v = (x.reshape(heads, total // chunk, chunk, -1) for x in (q, k, v))  # [H, N, C, D]
    g, beta = g.reshape(heads, -1, chunk), beta.reshape(heads, -1, chunk)  # [H, N, C]

    gamma = g.cumsum(dim=-1)  # log decay from the chunk start through each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0: [H, N, C, C]
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # (I + L) u = beta v - (beta exp(gamma) k) S0 with L[i, j] = beta_i (k_i . k_j) decay[i, j], j < i.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    writes = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C]
    q_from_start = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    out = torch.empty_like(v)
    for c in range(total // chunk):
        u = writes[:, c] - reads[:, c] @ state  # [H, C, Dv]
        out[:, c] = q_from_start[:, c] @ state + intra[:, c] @ u
        state = state * chunk_decay[:, c] + k_to_end[:, c].transpose(-1, -2) @ u
    return out.reshape(heads, total, -1)[:, :n].transpose(0, 1), state


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; its state lives in the state pool's slots. This class reads the
    separate input projections of Qwen3.5 (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``); a family with another projection layout overrides :meth:`_make_projections`
    and :meth:`_project` (Qwen3-Next's fused ones, in its family file)."""

    checkpoint_name = "linear_attn"
    chunked_rule = staticmethod(chunked_delta_rule)  # the prefill form of the recurrence

    def __init__(self, layer_idx: int, hidden: int, la: LinearAttentionConfig, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.la = la
        self.group = la.num_value_heads // la.num_key_heads  # value heads per key head
        self._make_projections(hidden, dtype)
        self.conv1d = _Weight(la.conv_dim, 1, la.conv_kernel, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(la.num_value_heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(la.num_value_heads, dtype=dtype), requires_grad=False)
        self.norm = GatedRMSNorm(la.value_head_dim, eps, dtype)
        self.out_proj = Projection(la.value_dim, hidden, False, dtype)

    def _make_projections(self, hidden: int, dtype: torch.dtype) -> None:
        la = self.la
        self.in_proj_qkv = Projection(hidden, la.conv_dim, False, dtype)
        self.in_proj_z = Projection(hidden, la.value_dim, False, dtype)
        self.in_proj_b = Projection(hidden, la.num_value_heads, False, dtype)
        self.in_proj_a = Projection(hidden, la.num_value_heads, False, dtype)

    def _project(self, x: torch.Tensor):
        """x [T, H] -> (qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        z = linear(x, self.in_proj_z.weight).view(x.shape[0], self.la.num_value_heads, -1)
        return linear(x, self.in_proj_qkv.weight), z, linear(x, self.in_proj_b.weight), linear(x, self.in_proj_a.weight)

    def _qkv_heads(self, mixed: torch.Tensor):
        """Convolved [n, conv_dim] -> fp32 q (normalised, scaled), k (normalised), v, with the key
        heads repeated for their value heads: [n, Hv, Dk], [n, Hv, Dk], [n, Hv, Dv]."""
        la, n = self.la, mixed.shape[0]
        q, k, v = mixed.float().split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
        q = l2_normalize(q.view(n, la.num_key_heads, -1)) * la.key_head_dim**-0.5
        k = l2_normalize(k.view(n, la.num_key_heads, -1))
        if self.group > 1:
            q, k = q.repeat_interleave(self.group, dim=1), k.repeat_interleave(self.group, dim=1)
        return q, k, v.view(n, la.num_value_heads, -1)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, H]
        batch = ctx.batch
        conv_cache = ctx.states.conv[self.layer_idx]  # [slots, conv_dim, K - 1]
        state_cache = ctx.states.recurrent[self.layer_idx]  # [slots, Hv, Dk, Dv] fp32
        qkv, z, b, a = self._project(x)
        beta = torch.sigmoid(b).float()  # [T, Hv]
        g = self._decay(a)  # <= 0
        if isinstance(batch, StaticBatch):  # a fixed-shape decode step: every row one token of its slot
            out = self._recurrent_update(qkv, g, beta, batch.state_slots, conv_cache, state_cache)
            return self._output(out, z, x.dtype)
        out = torch.empty(x.shape[0], self.la.num_value_heads, self.la.value_head_dim, dtype=torch.float32,
                          device=x.device)
        decode = [i for i, s in enumerate(batch.sequences) if s.query_len == 1 and not s.captures]
        if decode:
            self._decode(qkv, g, beta, out, batch, decode, conv_cache, state_cache)
        done = set(decode)
        for index in range(len(batch.sequences)):
            if index not in done:
                self._sequence(index, qkv, g, beta, out, batch, conv_cache, state_cache)
        return self._output(out, z, x.dtype)

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """The log decay g [T, Hv] of each token's state: ``-exp(A_log) * softplus(a + dt_bias)``."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer's output from the recurrence's o [T, Hv, Dv] (fp32) and the gate z [T, Hv, Dv]."""
        d = self.la.value_head_dim
        core = self.norm(out.to(dtype).view(-1, d), z.reshape(-1, d))
        return linear(core.view(out.shape[0], -1), self.out_proj.weight)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise convolution over ``window`` [B, C, K - 1 + n] -> SiLU'd [B, C, n]."""
        w = self.conv1d.weight
        return F.silu(F.conv1d(window.to(w.dtype), w, groups=w.shape[0]))

    def _decode(self, qkv, g, beta, out, batch, indices, conv_cache, state_cache) -> None:
        """Every single-token sequence of the step in one batched recurrent update."""
        rows = torch.tensor([batch.sequences[i].query_start for i in indices], dtype=torch.long, device=qkv.device)
        slots = torch.tensor([batch.sequences[i].state_slot for i in indices], dtype=torch.long, device=qkv.device)
        o = self._recurrent_update(qkv.index_select(0, rows), g.index_select(0, rows), beta.index_select(0, rows),
                                   slots, conv_cache, state_cache)
        out.index_copy_(0, rows, o)

    def _recurrent_update(self, qkv, g, beta, slots, conv_cache, state_cache) -> torch.Tensor:
        """One new token per row (qkv [B, conv_dim], g and beta [B, Hv]) of the sequences in state
        ``slots`` [B]: their convolution windows and states advance in place; o [B, Hv, Dv] fp32.
        Rows sharing a slot must carry the same token (a fixed-shape step's padding)."""
        window = torch.cat([conv_cache.index_select(0, slots), qkv[:, :, None]], dim=-1)
        conv_cache.index_copy_(0, slots, window[:, :, 1:].to(conv_cache.dtype))
        mixed = self._conv(window)[:, :, -1].to(qkv.dtype)  # [B, C]
        q, k, v = self._qkv_heads(mixed)
        o, state = recurrent_step(q, k, v, g, beta, state_cache.index_select(0, slots))
        state_cache.index_copy_(0, slots, state)
        return o

    def _sequence(self, index, qkv, g, beta, out, batch, conv_cache, state_cache) -> None:
        """One sequence's new tokens, in segments cut where the step snapshots the state."""
        seq = batch.sequences[index]
        start, n, slot = seq.query_start, seq.query_len, seq.state_slot
        history = conv_cache.shape[-1]  # K - 1
        window = torch.cat([conv_cache[slot], qkv[start : start + n].T.to(conv_cache.dtype)], dim=-1)  # [C, K-1+n]
        mixed = self._conv(window[None])[0].T.to(qkv.dtype)  # [n, C]
        q, k, v = self._qkv_heads(mixed)
        state = state_cache[slot]
        lo = 0
        for cut in sorted({*seq.captures, n}):
            rows = slice(lo, cut)
            if cut - lo == 1:
                o, state = recurrent_step(q[rows], k[rows], v[rows], g[start + lo][None], beta[start + lo][None],
                                          state[None])
                state = state[0]
            else:
                o, state = self.chunked_rule(q[rows], k[rows], v[rows], g[start + lo : start + cut],
                                             beta[start + lo : start + cut], state)
            out[start + lo : start + cut] = o
            if cut in seq.captures:
                batch.captured.setdefault((index, cut), {})[self.layer_idx] = (
                    window[:, cut : cut + history].clone(), state.clone())
            lo = cut
        conv_cache[slot] = window[:, n:]
        state_cache[slot] = state
