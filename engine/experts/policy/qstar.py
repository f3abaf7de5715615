"""The q* policy: how many of a step's m cache misses to fill over the link, the rest going to CPU.

Both paths read the same host memory. While fills run, the CPU experts get what the link leaves of
the host bandwidth, ``B_R = max(B_H - B_P, 0)`` (docs/design.md, the q* cost model). Each path costs a fixed dispatch
time plus bytes over bandwidth; the exposed time of a split is the slower path. Rounding the closed
form ``q ≈ m·B_P/B_H`` loses badly when B_R is small, so every integer q in 0..m is evaluated.

As in the design, the CPU share is planned at B_R whenever a device exists, even for q = 0: the
link keeps moving other layers' and steps' fills, and a filled expert keeps paying off in later
steps while a CPU-computed one does not. That is what makes "fill all" the choice when B_H ≈ B_P
(the RTX 5090 desktop of the design). Without a device the CPU gets all of B_H.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PathCost:
    """Affine cost of one path: ``fixed_s + bytes / bytes_per_s`` (zero when it gets no work)."""

    bytes_per_s: float
    fixed_s: float = 0.0

    def seconds(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        if self.bytes_per_s <= 0:
            return math.inf
        return self.fixed_s + nbytes / self.bytes_per_s


@dataclass(frozen=True)
class SplitCosts:
    """Inputs of the policy. ``link`` is None without a device; ``host_bytes_per_s`` (B_H) is None
    without CPU expert workers. ``cpu_fixed_s`` is the CPU path's per-dispatch cost. The per-pair
    compute costs only matter for many tokens per expert (prefill; see ``prefill.py``)."""

    expert_bytes: int
    link: PathCost | None
    host_bytes_per_s: float | None
    cpu_fixed_s: float = 0.0
    cpu_pair_s: float = 0.0  # CPU compute per extra (token, expert) pair beyond the weight read
    device_pair_s: float = 0.0  # the device's compute per (token, expert) pair

    @property
    def cpu(self) -> PathCost | None:
        """The CPU path's cost while fills run: bandwidth B_R = max(B_H - B_P, 0)."""
        if self.host_bytes_per_s is None:
            return None
        left = self.host_bytes_per_s - (self.link.bytes_per_s if self.link is not None else 0.0)
        return PathCost(max(left, 0.0), self.cpu_fixed_s)


def step_seconds(costs: SplitCosts, m: int, q: int) -> float:
    """Exposed time of filling q of m misses and computing m - q on the CPU (the slower path)."""
    cpu, link = costs.cpu, costs.link
    fill = 0.0 if q == 0 else (link.seconds(q * costs.expert_bytes) if link is not None else math.inf)
    rest = 0.0 if q == m else (cpu.seconds((m - q) * costs.expert_bytes) if cpu is not None else math.inf)
    return max(fill, rest)


def credit_seconds(costs: SplitCosts, credit: float) -> float:
    """A fill credit in units of one expert's CPU time (``S / B_H``), in seconds per fill."""
    if credit in (0.0, math.inf, -math.inf) or not costs.host_bytes_per_s:
        return credit
    return credit * costs.expert_bytes / costs.host_bytes_per_s


def best_q(costs: SplitCosts, m: int, credit: float = 0.0) -> int:
    """The integer q in 0..m with the least exposed time minus ``credit`` (in units of ``S / B_H``,
    see :func:`credit_seconds`) per fill; ties go to more fills (a filled expert can hit again in
    later steps, a CPU-computed one cannot). Credit 0 is the per-step optimum, +inf fills every
    miss and -inf none; ``hearth.engine.experts.policy.tuning`` picks the credit by measured step time."""
    if costs.link is None:
        return 0  # no device: every miss runs on the CPU
    if costs.cpu is None or credit == math.inf:
        return m  # no CPU workers, or told to fill everything
    if credit == -math.inf:
        return 0
    per_fill = credit_seconds(costs, credit)
    best, best_t = m, step_seconds(costs, m, m) - per_fill * m
    for q in range(m - 1, -1, -1):
        t = step_seconds(costs, m, q) - per_fill * q
        if t < best_t:
            best, best_t = q, t
    return best


def build_qtable(costs: SplitCosts, m_max: int, device: torch.device | str = "cpu",
                 credit: float = 0.0) -> torch.Tensor:
    """``qtable[m]`` = best q for m = 0..m_max, as an int64 tensor on ``device`` (read on device)."""
    return torch.tensor([best_q(costs, m, credit) for m in range(m_max + 1)], dtype=torch.long, device=device)


def forced_qtable(mode: str, m_max: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A table that forces q: ``zero`` (every miss on the CPU) or ``all`` (fill every miss)."""
    if mode == "zero":
        return torch.zeros(m_max + 1, dtype=torch.long, device=device)
    if mode == "all":
        return torch.arange(m_max + 1, dtype=torch.long, device=device)
    raise ValueError(f"unknown q mode '{mode}' (use 'table', 'step', 'zero' or 'all')")

