"""Kimi delta attention (KDA, Kimi-Linear): the gated delta rule of ``deltanet.py`` with one decay
per key channel instead of one per head, so each row of the state ``S`` [heads, Dk, Dv] fades at
its own rate. Per token t, with g_t [heads, Dk] (log decays, <= 0):

    S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T q_t

q, k and v have their own projections and short convolutions (one causal depthwise convolution over
the three, as the state pool keeps its history); the decays come from a low-rank projection plus
``dt_bias`` through softplus, scaled by ``-exp(A_log)`` per head; the output is RMS-normalised and
gated by a sigmoid of another low-rank projection. The state and the convolution's history live in
the recurrent-state slots, exactly as the gated DeltaNet's do, and prefill runs the chunked form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.engine.config import LinearAttentionConfig
from hearth.engine.layers.deltanet import CHUNK, GatedDeltaNet, _Weight
from hearth.engine.layers.linear import Projection
from hearth.engine.layers.norm import SigmoidGatedRMSNorm
from hearth.engine.ops import linear


def chunked_kda_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The per-channel gated delta rule over one sequence segment, chunk by chunk.

    q, k: [n, H, Dk] (q already scaled); v: [n, H, Dv]; g: [n, H, Dk]; beta: [n, H]; state:
    [H, Dk, Dv] (all fp32). Returns (o [n, H, Dv], final state)."""
    n = q.shape[0]
    pad = (-n) % chunk  # zero padding: g = 0 keeps the state, beta = k = 0 writes nothing
    q, k, v, g = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v, g))  # [H, n + pad, D]
    beta = F.pad(beta.transpose(0, 1), (0, pad))  # [H, n + pad]
    heads, total = beta.shape
    q, k, v, g = (x.reshape(heads, total // chunk, chunk, -1) for x in (q, k, v, g))  # [H, N, C, D]
    beta = beta.reshape(heads, -1, chunk)
    gamma = g.cumsum(dim=-2)  # log decay from the chunk start through each position, per channel
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    k_beta = k * beta[..., None]
    out = torch.empty_like(v)
    for c in range(total // chunk):
        gc = gamma[:, c]  # [H, C, Dk]
        # decay[i, j, d] = exp(gamma_i,d - gamma_j,d) for j <= i, else 0: [H, C, C, Dk] (one chunk at a time)
        decay = (gc[:, :, None, :] - gc[:, None, :, :]).masked_fill(above[..., None], float("-inf")).exp()
        # (I + L) u = beta v - (beta k exp(gamma)) S0, L[i, j] = beta_i sum_d k_i,d k_j,d decay[i, j, d], j < i
        system = (k_beta[:, c, :, None, :] * k[:, c, None, :, :] * decay).sum(dim=-1)
        writes = torch.linalg.solve_triangular(system, v[:, c] * beta[:, c, :, None], upper=False, unitriangular=True)
        reads = torch.linalg.solve_triangular(system, k_beta[:, c] * gc.exp(), upper=False, unitriangular=True)
        intra = (q[:, c, :, None, :] * k[:, c, None, :, :] * decay).sum(dim=-1)  # [H, C, C]
        u = writes - reads @ state  # [H, C, Dv]
        out[:, c] = (q[:, c] * gc.exp()) @ state + intra @ u
        last = gc[:, -1:, :]  # [H, 1, Dk]
        state = state * last.exp().transpose(-1, -2) + (k[:, c] * (last - gc).exp()).transpose(-1, -2) @ u
    return out.reshape(heads, total, -1)[:, :n].transpose(0, 1), state


class KimiDeltaAttention(GatedDeltaNet):
    """One KDA layer (``self_attn``, in the names Moonshot ships): ``q/k/v_proj`` and
    ``q/k/v_conv1d``, the decay's ``f_a_proj`` -> ``f_b_proj`` + ``dt_bias`` and ``A_log``, the write
    strength ``b_proj``, the output gate ``g_a_proj`` -> ``g_b_proj``, ``o_norm`` and ``o_proj``.
    Heads of keys and values are one and the same (``la.num_key_heads``)."""

    checkpoint_name = "self_attn"
    chunked_rule = staticmethod(chunked_kda_rule)

    def __init__(self, layer_idx: int, hidden: int, la: LinearAttentionConfig, eps: float, dtype: torch.dtype) -> None:
        # Not GatedDeltaNet.__init__: its parameters (one fused projection, per-head A_log and dt_bias,
        # one convolution) are not KDA's. The attributes its methods read are set here.
        nn.Module.__init__(self)
        self.layer_idx, self.la, self.group = layer_idx, la, 1
        width, rank, kernel = la.key_dim, la.key_head_dim, la.conv_kernel
        self.q_proj, self.k_proj, self.v_proj = (Projection(hidden, width, False, dtype) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (_Weight(width, 1, kernel, dtype=dtype) for _ in range(3))
        self.A_log = nn.Parameter(torch.empty(1, 1, la.num_key_heads, 1, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=dtype), requires_grad=False)
        self.f_a_proj, self.f_b_proj = Projection(hidden, rank, False, dtype), Projection(rank, width, False, dtype)
        self.b_proj = Projection(hidden, la.num_key_heads, False, dtype)
        self.g_a_proj, self.g_b_proj = Projection(hidden, rank, False, dtype), Projection(rank, width, False, dtype)
        self.o_norm = SigmoidGatedRMSNorm(la.value_head_dim, eps, dtype)
        self.o_proj = Projection(width, hidden, False, dtype)

    def _project(self, x: torch.Tensor):
        """x [T, H] -> (qkv [T, 3 W], output gate [T, heads, D], b [T, heads], decay input [T, W])."""
        qkv = torch.cat([linear(x, p.weight) for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        gate = linear(linear(x, self.g_a_proj.weight), self.g_b_proj.weight).view(x.shape[0], self.la.num_key_heads, -1)
        return qkv, gate, linear(x, self.b_proj.weight), linear(linear(x, self.f_a_proj.weight), self.f_b_proj.weight)

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        """g [T, heads, Dk] = -exp(A_log) * softplus(a + dt_bias), per key channel."""
        g = (a.float() + self.dt_bias.float()).view(a.shape[0], self.la.num_key_heads, -1)
        return -self.A_log.float().exp().view(-1, 1) * F.softplus(g)

    def _conv(self, window: torch.Tensor) -> torch.Tensor:
        """Causal depthwise convolution of q, k and v together over ``window`` [B, 3 W, K - 1 + n]."""
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        return F.silu(F.conv1d(window.to(w.dtype), w, groups=w.shape[0]))

    def _output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = self.la.value_head_dim
        core = self.o_norm(out.to(dtype).view(-1, d), z.reshape(-1, d))
        return linear(core.view(out.shape[0], -1), self.o_proj.weight)


class LingDeltaAttention(KimiDeltaAttention):
    """Ling 3.0's delta attention (``BailingHybridForCausalLM``): full-rank decay (``f_proj``) and
    output-gate (``g_proj``) projections, ``A_log`` one per head, and with ``safe_gate`` the decay
    ``lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))`` instead of the softplus form; the
    decays rounded to the model dtype, the convolutions, ``dt_bias`` and ``A_log`` held in fp32 (as
    transformers keeps them)."""

    def __init__(self, layer_idx: int, hidden: int, la: LinearAttentionConfig, eps: float, dtype: torch.dtype, *,
                 safe_gate: bool, lower_bound: float) -> None:
        nn.Module.__init__(self)  # (not KimiDeltaAttention's: see there; these parameters are Ling's)
        self.layer_idx, self.la, self.group, self.dtype = layer_idx, la, 1, dtype
        width, kernel, heads = la.key_dim, la.conv_kernel, la.num_key_heads
        self.q_proj, self.k_proj, self.v_proj = (Projection(hidden, width, False, dtype) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (_Weight(width, 1, kernel, dtype=torch.float32)
                                                       for _ in range(3))
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.f_proj, self.g_proj = Projection(hidden, width, False, dtype), Projection(hidden, width, False, dtype)
        self.b_proj = Projection(hidden, heads, False, dtype)
        self.o_norm = SigmoidGatedRMSNorm(la.value_head_dim, eps, dtype)
        self.o_proj = Projection(width, hidden, False, dtype)
        self.safe_gate, self.lower_bound = safe_gate, lower_bound

    def _project(self, x: torch.Tensor):
        qkv = torch.cat([linear(x, p.weight) for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        gate = linear(x, self.g_proj.weight).view(x.shape[0], self.la.num_key_heads, -1)
        return qkv, gate, linear(x, self.b_proj.weight), linear(x, self.f_proj.weight)

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        g = (a.float() + self.dt_bias.float()).view(a.shape[0], self.la.num_key_heads, -1)
        rate = self.A_log.float().exp().view(-1, 1)
        g = self.lower_bound * torch.sigmoid(rate * g) if self.safe_gate else -rate * F.softplus(g)
        return g.to(self.dtype).float()
