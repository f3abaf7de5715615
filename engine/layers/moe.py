"""MoE block: the router (gating, top-k, normalisation) and the hand-off of routed tokens to an expert
backend, plus an optional shared expert. Families choose the router's rules and the shared expert."""

from __future__ import annotations

import torch
from torch import nn

from hearth.engine.experts.contract import ExpertBackend
from hearth.engine.layers.batch import LayerContext, StaticBatch
from hearth.engine.layers.linear import Projection
from hearth.engine.ops import linear


class TopKRouter(nn.Module):
    """Softmax gating over all experts and top-k selection; ``normalize`` renormalises the k weights,
    ``weights_in_fp32`` keeps them in fp32 when combining (Mixtral) instead of the model dtype (Qwen)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, *, normalize: bool,
                 weights_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.top_k = top_k
        self.normalize = normalize
        self.weights_in_fp32 = weights_in_fp32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k])."""
        return self.select(linear(x, self.weight))  # logits [T, E]

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing of logits [T, E] (in the model dtype): (topk_ids [T, k], topk_weights [T, k])."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(logits.dtype)
        return ids, weights


class PNormRouter(TopKRouter):
    """DBRX's routing: a softmax over all experts in the model dtype, the top k, and their weights
    divided by their ``p``-norm (none where ``p`` is None), kept in the model dtype."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, *, p: float | None) -> None:
        super().__init__(hidden, num_experts, top_k, dtype, normalize=p is not None)
        self.p = p

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=logits.dtype), self.top_k, dim=-1)
        if self.p is not None:
            weights = weights / torch.norm(weights, p=self.p, dim=-1, keepdim=True)
        return ids, weights


class TopKSoftmaxRouter(nn.Module):
    """GPT-OSS's routing: the gate's logits (with its bias), the top k of them, and a softmax over
    those k only, in the model dtype."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in the model dtype)."""
        top, ids = torch.topk(torch.nn.functional.linear(x, self.weight, self.bias), self.top_k, dim=-1)
        return ids, torch.softmax(top, dim=1, dtype=top.dtype)


class TopKThenScoreRouter(nn.Module):
    """Cohere2-MoE's routing: the top k of the gate's logits first, then their scores, a softmax over
    those k in fp32 or their sigmoids in the model dtype (renormalised where ``normalize``); the
    weights in the model dtype."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, *, scoring: str,
                 normalize: bool) -> None:
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"expert selection '{scoring}' is not supported (softmax, sigmoid are)")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.top_k, self.scoring, self.normalize = top_k, scoring, normalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in the model dtype)."""
        top, ids = torch.topk(linear(x, self.weight), self.top_k, dim=-1)
        if self.scoring == "softmax":
            return ids, torch.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype)
        weights = torch.sigmoid(top)
        return ids, (weights / weights.sum(dim=-1, keepdim=True) if self.normalize else weights).to(x.dtype)


class SparseMixerRouter(nn.Module):
    """Phi-3.5-MoE's routing at inference (SparseMixer), in the model dtype, always two experts: the
    best logit, weighted by a softmax over the experts whose logits lie within ``2 * jitter_eps``
    (relative) of it; then the best of the others, weighted the same way among the rest."""

    top_k = 2

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype, *, jitter_eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.jitter_eps = jitter_eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, 2] int64, topk_weights [T, 2] in the model dtype)."""
        scores = linear(x, self.weight)  # [T, E]
        masked, ids, weights = scores, [], []
        for _ in range(2):
            best, idx = masked.max(dim=-1, keepdim=True)
            far = (best - scores) / scores.abs().clamp(min=best) > 2 * self.jitter_eps
            weights.append(torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx))
            ids.append(idx)
            masked = masked.scatter(-1, idx, float("-inf"))
        return torch.cat(ids, dim=-1), torch.cat(weights, dim=-1)


class GroupedTopKRouter(nn.Module):
    """DeepSeek-style routing, all in fp32: sigmoid (or softmax) scores over the experts; the choice
    made on the scores plus ``e_score_correction_bias`` (where the family has one), first of the
    ``topk_group`` best of ``n_group`` expert groups (a group scored by the sum of its two best, or
    by its best: ``group_score`` "top2" or "max"), then of the top k inside them; the k weights are
    the plain scores, renormalised where ``normalize``, times ``scaling``. Weights stay fp32 unless
    ``weights_dtype`` rounds them (ERNIE-4.5: to the model dtype). ``logits_in_fp32`` False: the gate's
    product in the model dtype, then scored in fp32. ``bias_on_logits``: the correction bias shifts the
    logits for the choice rather than the scores (Kolibri-1's). ``softcap`` > 0: the fp32 logits capped
    by ``tanh(logits / softcap) * softcap`` first (Laguna's)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, *, scoring: str = "sigmoid",
                 correction_bias: bool = True, n_group: int = 1, topk_group: int = 1, group_score: str = "top2",
                 normalize: bool = True, scaling: float = 1.0, logits_in_fp32: bool = True,
                 weights_dtype: torch.dtype = torch.float32, bias_on_logits: bool = False,
                 softcap: float = 0.0) -> None:
        super().__init__()
        if scoring not in ("sigmoid", "softmax") or group_score not in ("top2", "max"):
            raise ValueError(f"routing: scoring {scoring!r} / group score {group_score!r} unknown")
        if num_experts % max(n_group, 1):
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if correction_bias else None)
        self.top_k, self.scoring, self.normalize, self.scaling = top_k, scoring, normalize, scaling
        self.n_group, self.topk_group, self.group_score = max(n_group, 1), topk_group, group_score
        self.logits_in_fp32 = logits_in_fp32  # False: the gate's product in the model dtype (MiniMax-M2)
        self.weights_dtype, self.bias_on_logits, self.softcap = weights_dtype, bias_on_logits, softcap
        self._weight_fp32: torch.Tensor | None = None  # made on first use (after loading), kept

    def fp32_weight(self) -> torch.Tensor:
        """The gate's weight in fp32, converted once rather than at every step (no copy when fp32)."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        if self._weight_fp32 is None or self._weight_fp32.device != w.device:
            self._weight_fp32 = w.float()
        return self._weight_fp32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in ``weights_dtype``)."""
        logits = (torch.nn.functional.linear(x.float(), self.fp32_weight()) if self.logits_in_fp32
                  else linear(x, self.weight).float())  # [T, E]
        if self.softcap > 0:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(dim=-1)
        base = logits if self.bias_on_logits else scores
        choice = base if self.e_score_correction_bias is None else base + self.e_score_correction_bias
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if self.group_score == "top2" else grouped.amax(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            # Outside the chosen groups: -inf where a bias shifts the choice, 0 where the choice is the score.
            fill = float("-inf") if self.e_score_correction_bias is not None else 0.0
            choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(t, e), fill)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids) if self.e_score_correction_bias is not None else choice.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, (weights * self.scaling).to(self.weights_dtype)


_SCORES = {"sqrtsoftplus": lambda x: torch.nn.functional.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


class ScoredTopKRouter(nn.Module):
    """DeepSeek-V4's routing, in the model dtype: scores ``sqrt(softplus(logits))`` (or sigmoid), the
    top k of scores plus ``e_score_correction_bias`` (fp32; none where ``correction_bias`` is False),
    their plain scores renormalised (``normalize``; ``eps`` added to the sum) and times ``scaling``.
    LFM2-MoE routes the same way with sigmoid scores. :class:`HashRouter` picks the experts from the
    token instead."""

    reads_tokens = False

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, *, scoring: str,
                 scaling: float, correction_bias: bool = True, normalize: bool = True, eps: float = 1e-20) -> None:
        super().__init__()
        if scoring not in _SCORES:
            raise ValueError(f"routing: scoring {scoring!r} unknown ({', '.join(_SCORES)})")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                     requires_grad=False) if correction_bias else None)
        self.top_k, self.score, self.scaling = top_k, _SCORES[scoring], scaling
        self.normalize, self.eps = normalize, eps

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in the model dtype)."""
        scores = self.score(linear(x, self.weight))  # [T, E]
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        return ids, self.weigh(scores, ids)

    def weigh(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + self.eps)
        return weights * self.scaling


class HashRouter(ScoredTopKRouter):
    """DeepSeek-V4's first layers: each token id's k experts fixed by the table ``tid2eid``
    [vocab, k]; the gate's scores still weigh them."""

    reads_tokens = True

    def __init__(self, hidden: int, num_experts: int, top_k: int, dtype: torch.dtype, *, scoring: str,
                 scaling: float, vocab_size: int) -> None:
        super().__init__(hidden, num_experts, top_k, dtype, scoring=scoring, scaling=scaling, correction_bias=False)
        self.tid2eid = nn.Parameter(torch.zeros(vocab_size, top_k, dtype=torch.int64), requires_grad=False)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tid2eid.index_select(0, token_ids)
        return ids, self.weigh(self.score(linear(x, self.weight)), ids)


class MoEBlock(nn.Module):
    """Routed experts (through the backend, by global id ``layer * E + expert``) plus an optional
    shared expert, scaled by the sigmoid of ``shared_expert_gate`` when there is one, or averaged with
    the routed output where ``shared_average`` (Cohere2-MoE's "average" strategy)."""

    def __init__(self, layer_idx: int, num_experts: int, router: nn.Module, backend: ExpertBackend,
                 shared_expert: nn.Module | None = None, shared_expert_gate: Projection | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.first_expert_id = layer_idx * num_experts
        self.gate = router
        self.backend = backend
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.shared_average = False
        self.routed_scale = 1.0  # the routed experts' sum times this, in the model dtype (Laguna's)

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:
        ids, weights = self.gate(x, ctx.batch.token_ids) if getattr(self.gate, "reads_tokens", False) else self.gate(x)
        if ctx is not None and isinstance(ctx.batch, StaticBatch):  # a fixed-shape decode step (executor/fixed_shape)
            out = self.backend.forward_static(x, ids + self.first_expert_id, weights, self.layer_idx)
        else:
            out = self.backend.forward(x, ids + self.first_expert_id, weights, ctx.batch.experts if ctx else None)
        if self.routed_scale != 1.0:
            out = out * self.routed_scale
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * shared
        return (out + shared) / 2 if self.shared_average else out + shared


class PostNormedMoEBlock(MoEBlock):
    """An MoE block whose output (routed plus shared) is normalised before the residual add (A.X K1's
    ``post_mlp_layernorm``)."""

    def __init__(self, *args, post_mlp_layernorm: nn.Module, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.post_mlp_layernorm = post_mlp_layernorm

    def forward(self, x: torch.Tensor, ctx: LayerContext | None = None) -> torch.Tensor:
        return self.post_mlp_layernorm(super().forward(x, ctx))
