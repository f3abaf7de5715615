"""Elastic VRAM, the decision: how large the device expert cache should be for the GPU memory that
is free now (pure; the watcher in ``mechanism/vram_watch.py`` reads the GPU and carries it out)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VramPolicy:
    """``reserve``: bytes left free for other programs; ``ceiling``: the most the cache may hold (its
    size at start); ``grow_step``: the least growth worth a resize (a neighbour whose memory use
    wobbles does not make the cache resize at every reading); ``expert_bytes``: one slot."""

    reserve: int
    ceiling: int
    expert_bytes: int
    grow_step: int = 0


def elastic_budget(free: int, cache_bytes: int, policy: VramPolicy) -> int | None:
    """The cache's new size in bytes (whole slots), or None to keep it. The cache may hold what it
    holds plus whatever is free beyond the reserve, up to the ceiling. It shrinks as soon as that is
    at least one slot less than it holds (another program needs the memory now); it grows only by
    at least ``grow_step`` and one slot."""
    target = max(0, min(policy.ceiling, cache_bytes + free - policy.reserve))
    target -= target % policy.expert_bytes
    if cache_bytes - target >= policy.expert_bytes:
        return target
    if target - cache_bytes >= max(policy.grow_step, policy.expert_bytes):
        return target
    return None


def default_cache_bytes(kind: str, free: int, pool_bytes: int, limit: int | None, in_use: int,
                        share: float = 0.8) -> int:
    """The expert cache's size when none is given: ``share`` of the GPU's ``free`` memory (CUDA), a
    quarter of the pool (the virtual device). With ``limit`` (``--vram-limit``: all the memory the
    executor may take on its device, to leave the rest to other programs or to stand in for a
    smaller GPU) at most ``share`` of what the limit leaves past ``in_use`` (the dense weights and
    the KV cache), on either device."""
    wanted = int(free * share) if kind == "cuda" else pool_bytes // 4
    if limit is None:
        return wanted
    allowed = int(max(limit - in_use, 0) * share)
    return min(wanted, allowed) if kind == "cuda" else allowed
