"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual stream is ``n`` parallel
streams per token, [T, n, H]. Before each block a learned mix collapses them into the block's
input; after it, the block's output is spread back over the streams and added to the streams
mixed by a doubly stochastic matrix (Sinkhorn-normalised), so deep stacks do not blow up.

The mixing weights are computed in fp32 from the streams themselves, and combined with the
streams in the model dtype, in transformers' order, so that bf16 matches it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x²) + eps)``, the rsqrt in fp32 and cast to x's dtype before the product."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The mixing around one block (``attn_hc`` or ``ffn_hc``): ``fn`` [(2 + n) n, n H] projects the
    normalised streams to the pre (n), post (n) and comb (n x n) logits; ``base`` and ``scale`` shift
    and scale them."""

    def __init__(self, streams: int, hidden: int, sinkhorn_iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        n = streams
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        self.streams, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [T, n, H] -> (post [T, n] fp32, comb [T, n, n] fp32, the block's input [T, H])."""
        t, n = h.shape[0], self.streams
        mixes = F.linear(unweighted_rms_norm(h.reshape(t, -1).float(), self.norm_eps), self.fn)  # [T, (2+n)n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(t, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to one
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after a block: its output ``out`` [T, H] spread by ``post``, plus the streams
        ``h`` [T, n, H] mixed by ``comb`` (transposed: output stream k sums comb[j, k] h[j])."""
        dtype = h.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)


class HyperHead(nn.Module):
    """The last collapse of the streams into one, before the final norm (``hc_head``)."""

    def __init__(self, streams: int, hidden: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(streams, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.eps, self.norm_eps = eps, norm_eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, n, H] -> [T, H]."""
        mixes = F.linear(unweighted_rms_norm(h.flatten(1).float(), self.norm_eps), self.hc_fn)  # [T, n]
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
