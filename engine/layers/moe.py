"""MoE block: the router (gating, top-k, normalisation, shared-expert gate) and the hand-off of
routed tokens to an expert backend."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.experts import ExpertBackend
from engine.layers.linear import Projection, linear
from engine.layers.mlp import GatedMLP


class TopKRouter(nn.Module):
    """Softmax gating over all experts, top-k selection and optional renormalisation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, dtype=cfg.dtype), requires_grad=False
        )
        self.top_k = cfg.top_k
        self.normalize = cfg.norm_topk_prob
        self.weights_in_fp32 = cfg.router_weights_in_fp32

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k])."""
        logits = linear(x, self.weight)  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(logits.dtype)
        return ids, weights


class MoEBlock(nn.Module):
    """Routed experts (through the backend) plus an optional sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, backend: ExpertBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.first_expert_id = layer_idx * cfg.num_experts  # global ids g = layer * E + expert
        self.gate = TopKRouter(cfg)
        self.backend = backend
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Projection | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(
                cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act, cfg.dtype
            )
            self.shared_expert_gate = Projection(cfg.hidden_size, 1, False, cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.backend.forward(x, ids + self.first_expert_id, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return out
