"""The recurrent-state pool of hybrid models: one slot per running sequence.

Every linear-attention layer keeps, per slot, the last ``K - 1`` inputs of its causal convolution
(model dtype) and its gated-delta-rule state (fp32). A sequence gets a slot when it is admitted and
gives it back when it finishes or is preempted; its slot is reset to zeros, or loaded from a
checkpoint, before its first step (:meth:`RecurrentStatePool.prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hearth.engine.config import ModelConfig


@dataclass(frozen=True)
class StateSnapshot:
    """Copies of one sequence's recurrent state after some prefix: layer -> (conv, state)."""

    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes + s.nbytes for c, s in self.layers.values())


class RecurrentStatePool:
    """Conv and recurrent state tensors of every linear-attention layer, by slot."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device | str = "cpu") -> None:
        la = cfg.linear_attention
        if la is None or not cfg.linear_layer_ids:
            raise ValueError(f"{cfg.architecture} has no linear-attention layers")
        self.num_slots = num_slots
        self.nbytes = self.bytes_per_sequence(cfg)  # of one slot, and of one checkpoint
        history = la.conv_kernel - 1
        self.conv = {i: torch.zeros(num_slots, la.conv_dim, history, dtype=cfg.dtype, device=device)
                     for i in cfg.linear_layer_ids}
        self.recurrent = {
            i: torch.zeros(num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim,
                           dtype=torch.float32, device=device)
            for i in cfg.linear_layer_ids
        }

    @staticmethod
    def bytes_per_sequence(cfg: ModelConfig) -> int:
        """Bytes of one slot (also the size of one checkpoint)."""
        la = cfg.linear_attention
        if la is None:
            return 0
        elem = torch.empty((), dtype=cfg.dtype).element_size()
        conv = la.conv_dim * (la.conv_kernel - 1) * elem
        state = la.num_value_heads * la.key_head_dim * la.value_head_dim * 4
        return len(cfg.linear_layer_ids) * (conv + state)

    def prepare(self, slot: int, source: StateSnapshot | None) -> None:
        """Start ``slot`` from ``source`` (a checkpoint), or from zeros (an empty prefix)."""
        for i in self.conv:
            if source is None:
                self.conv[i][slot].zero_()
                self.recurrent[i][slot].zero_()
            else:
                conv, state = source.layers[i]
                self.conv[i][slot].copy_(conv)
                self.recurrent[i][slot].copy_(state)

    def snapshot(self, slot: int) -> StateSnapshot:
        """A copy of ``slot``'s current state."""
        return StateSnapshot({i: (self.conv[i][slot].clone(), self.recurrent[i][slot].clone()) for i in self.conv})
