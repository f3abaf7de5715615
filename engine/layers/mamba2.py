"""Mamba-2, the state-space token mixer of Granite 4's hybrid layers (``GraniteMoeHybridForCausalLM``).

``in_proj`` gives the gate z [I], the convolved channels xBC [I + 2 G N] and the step dt [heads]; xBC goes
through a causal depthwise convolution and SiLU and splits into x (heads of P channels), B and C (G groups
of N); per head h, with dt = softplus(dt + dt_bias) and A = -exp(A_log):

    state_h <- exp(dt_h A_h) state_h + dt_h x_h (x) B_g        (state_h [P, N], fp32)
    y_h     =  state_h . C_g + D_h x_h

then y is normed in groups after gating by SiLU(z) and projected back by ``out_proj``. Each sequence's
state is the convolution's last K - 1 inputs and the [heads, P, N] states, in the recurrent-state pool's
slots. As in transformers, a decode step computes B, C, the products and the output in the model dtype
(the state in fp32), and several tokens of a sequence go through the recurrence in fp32 and are rounded
once (transformers' chunked scan; here the same sums token by token)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.layers.batch import LayerContext, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.short_conv import _Conv
from hearth.engine.ops import linear


class GroupRMSNormGated(nn.Module):
    """y * SiLU(z), then RMS-normed in groups of ``group`` channels, times ``weight`` (in fp32; the
    result in ``y``'s dtype before the weight, as transformers rounds it)."""

    def __init__(self, width: int, group: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)
        self.group, self.eps = group, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer (shapes: ``heads`` of ``head_dim`` channels, ``groups`` of ``state`` for B and
    C, a ``kernel``-tap convolution); its state lives in the state pool's slots."""

    checkpoint_name = "mamba"

    def __init__(self, layer_idx: int, hidden: int, *, heads: int, head_dim: int, groups: int, state: int,
                 kernel: int, conv_bias: bool, proj_bias: bool, eps: float, dtype: torch.dtype,
                 dt_limit: tuple[float, float] = (0.0, float("inf"))) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.dt_limit = dt_limit  # (transformers clamps dt to it over several tokens, not in a decode step)
        self.heads, self.head_dim, self.groups, self.state = heads, head_dim, groups, state
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state
        self.in_proj = Projection(hidden, self.inner + self.conv_dim + heads, proj_bias, dtype)
        self.conv1d = _Conv(self.conv_dim, kernel, conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
        self.norm = GroupRMSNormGated(self.inner, self.inner // groups, eps, dtype)
        self.out_proj = Projection(self.inner, hidden, proj_bias, dtype)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:  # x: [T, H]
        batch = ctx.batch
        conv_cache, state_cache = ctx.states.conv[self.layer_idx], ctx.states.recurrent[self.layer_idx]
        z, xbc, dt = linear(x, self.in_proj.weight, self.in_proj.bias).split(
            [self.inner, self.conv_dim, self.heads], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # [T, heads] in the model dtype
        if isinstance(batch, StaticBatch):  # a fixed-shape decode step: every row one token of its slot
            y = self._step(xbc, dt, batch.state_slots, conv_cache, state_cache)
            return linear(self.norm(y, z).to(x.dtype), self.out_proj.weight, self.out_proj.bias)
        out = torch.empty_like(z)
        for index, seq in enumerate(batch.sequences):
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.query_len == 1 and not seq.captures:
                slot = torch.tensor([seq.state_slot], device=x.device)
                y = self._step(xbc[rows], dt[rows], slot, conv_cache, state_cache)
            else:
                y = self._sequence(index, seq, xbc[rows], dt[rows], batch, conv_cache, state_cache)
            out[rows] = self.norm(y, z[rows]).to(x.dtype)
        return linear(out, self.out_proj.weight, self.out_proj.bias)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """[B, C, K - 1 + n] -> SiLU'd [B, C, n] in the window's dtype."""
        return F.silu(self.conv1d(window))

    def _split(self, mixed: torch.Tensor):
        """Convolved [n, C] -> x [n, heads, P], B and C [n, heads, N] (each group's for its heads)."""
        x, b, c = mixed.split([self.inner, self.groups * self.state, self.groups * self.state], dim=-1)
        per = self.heads // self.groups
        b = b.view(-1, self.groups, 1, self.state).expand(-1, -1, per, -1).reshape(-1, self.heads, self.state)
        c = c.view(-1, self.groups, 1, self.state).expand(-1, -1, per, -1).reshape(-1, self.heads, self.state)
        return x.view(-1, self.heads, self.head_dim), b, c

    def _step(self, xbc, dt, slots, conv_cache, state_cache) -> torch.Tensor:
        """One token per row (xbc [B, C], dt [B, heads]) of the sequences in state ``slots``: their
        windows and states advance in place; y [B, I] in the model dtype."""
        window = torch.cat([conv_cache.index_select(0, slots), xbc[:, :, None].to(conv_cache.dtype)], dim=-1)
        conv_cache.index_copy_(0, slots, window[:, :, 1:])
        x, b, c = self._split(self._conv(window)[:, :, -1].to(xbc.dtype))
        decay = torch.exp(dt.float() * -torch.exp(self.A_log.float()))  # [B, heads]
        dbx = (dt[:, :, None] * b)[:, :, None, :] * x[..., None]  # [B, heads, P, N], model dtype
        state = state_cache.index_select(0, slots) * decay[..., None, None] + dbx
        state_cache.index_copy_(0, slots, state)
        y = torch.matmul(state.to(c.dtype), c[..., None])[..., 0]  # [B, heads, P]
        return (y + x * self.D[:, None]).reshape(-1, self.inner)

    def _sequence(self, index, seq, xbc, dt, batch, conv_cache, state_cache) -> torch.Tensor:
        """A sequence's n new tokens after its history, the recurrence in fp32; the histories and states
        at the step's capture points are kept. y [n, I] fp32."""
        slot, n, history = seq.state_slot, seq.query_len, conv_cache.shape[-1]
        window = torch.cat([conv_cache[slot], xbc.T.to(conv_cache.dtype)], dim=-1)  # [C, K - 1 + n]
        x, b, c = (t.float() for t in self._split(self._conv(window[None])[0].T.to(xbc.dtype)))
        dtf = dt.clamp(*self.dt_limit).float()
        decay = torch.exp(dtf * -torch.exp(self.A_log.float()))  # [n, heads]
        state, ys = state_cache[slot].clone(), []
        for t in range(n):
            state = state * decay[t][:, None, None] + (dtf[t][:, None, None] * x[t][..., None]) * b[t][:, None, :]
            ys.append(torch.einsum("hpn,hn->hp", state, c[t]))
            if t + 1 in seq.captures:
                batch.captured.setdefault((index, t + 1), {})[self.layer_idx] = (
                    window[:, t + 1 : t + 1 + history].clone(), state.clone())
        conv_cache[slot] = window[:, n:]
        state_cache[slot] = state
        y = torch.stack(ys) + x * self.D.float()[:, None]  # [n, heads, P]
        return y.reshape(n, self.inner)
