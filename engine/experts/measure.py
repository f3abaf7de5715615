"""Measure the two bandwidths the q* policy needs, with the real paths on real expert shapes.

B_H: the CPU expert kernel itself on the model's experts, cycling through the pool so the weights
come from DRAM rather than the last-level cache (a plain memory-read loop over-reports it).
B_P: batched fills of real slot sizes through the path the steps will fill by: the device's own
copy path (DMA on its copy stream) for eager steps, the count-aware fill op (SM loads of the mapped
pool, ``kernels/gpu/device_fill.py``) for captured ones, whose rate can differ. Each path is fitted as
affine (fixed dispatch cost + bytes/bandwidth) from runs with 1 and with k experts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from hearth.engine.executor import graph_ops  # noqa: F401 - registers torch.ops.hearth.*, which link_fill calls
from hearth.engine.experts.compute import routed_partial_sum
from hearth.engine.experts.contract import FillPlan
from hearth.engine.experts.policy.qstar import PathCost
from hearth.engine.experts.pool import ExpertPool


def _fit(n_small: int, t_small: float, n_big: int, t_big: float, expert_bytes: int) -> PathCost:
    """Affine fit through two (experts, seconds) points; bandwidth from the slope."""
    slope = (t_big - t_small) / max(n_big - n_small, 1)
    if slope <= 0:  # noise: fall back to the big run's average
        slope, fixed = t_big / n_big, 0.0
    else:
        fixed = max(t_small - slope * n_small, 0.0)
    return PathCost(expert_bytes / slope, fixed)


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure_host_path(pool: ExpertPool, act, k: int, repeats: int = 5) -> PathCost:
    """Affine cost of the CPU expert path at batch 1, reading experts from DRAM."""
    x = torch.randn(1, pool.hidden).to(pool.dtype)
    n_rows = pool.gate_up.shape[0]
    blocks = pool.layer_blocks(pool.moe_layer_ids[0])
    cursor = [0]

    def run(n: int) -> None:
        # Consecutive calls walk the pool, so no expert is still in cache from the last call.
        rows = [(cursor[0] + j) % n_rows for j in range(n)]
        cursor[0] = (cursor[0] + n) % n_rows
        routed_partial_sum(x, pool.gate_up, pool.down, torch.tensor([rows]), torch.full((1, n), 1.0 / n), act,
                           blocks)

    k = max(min(k, n_rows), 2)
    run(k)  # warm-up (kernel build, allocator)
    t1, tk = _median_time(lambda: run(1), repeats), _median_time(lambda: run(k), repeats)
    return _fit(1, t1, k, tk, pool.expert_bytes)


# The paths a fill can take: the device's batched copy (device.fill, eager steps), or the fill op
# that captured steps run (torch.ops.hearth.fill_slots on the device's fill_sources()).
LINK_PATHS = ("copy", "fill_op")


def link_fill(device, src: torch.Tensor, dst: torch.Tensor, path: str = "copy") -> Callable[[], None]:
    """A function that copies global ids ``src`` into slots ``dst`` through ``path``
    (:data:`LINK_PATHS`) and waits for it; the ids go to the device once, here, so that timing the
    function times the fill. The fill op has no rate limit on the virtual device (captured steps
    never run there)."""
    if path not in LINK_PATHS:
        raise ValueError(f"link path '{path}': one of {', '.join(LINK_PATHS)}")
    src, dst = src.to(device.device), dst.to(device.device)
    if path == "copy":
        plan = FillPlan(torch.empty(0, dtype=torch.long), src, dst, torch.tensor(src.numel()))
        return lambda: (device.fill(plan), device.synchronize())
    count = torch.tensor(src.numel(), device=device.device)  # read by the op where it copies, as in a step
    gate_up_src, down_src, rows_of = device.fill_sources()
    return lambda: (torch.ops.hearth.fill_slots(device.gate_up, device.down, gate_up_src, down_src, rows_of, src,
                                                dst, count), device.synchronize())


def measure_link_path(device, pool: ExpertPool, k: int, repeats: int = 5, path: str = "copy") -> PathCost:
    """Affine cost of filling slots through ``path`` (:func:`link_fill`; the rate limit included
    on the virtual device's copy path)."""
    k = max(min(k, device.num_slots, pool.gate_up.shape[0]), 1)
    first_moe = pool.moe_layer_ids[0] * pool.num_experts
    fill = {n: link_fill(device, torch.arange(first_moe, first_moe + n) % pool.num_global_ids, torch.arange(n), path)
            for n in {1, k}}
    fill[k]()  # warm-up
    t1, tk = _median_time(fill[1], repeats), _median_time(fill[k], repeats)
    if k == 1:
        return PathCost(pool.expert_bytes / max(t1, 1e-9))
    return _fit(1, t1, k, tk, pool.expert_bytes)


def measure_stream_read(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes/s of a plain parallel reduction over a buffer far larger than the caches: a reference
    for how much of the memory system the expert kernel uses (not a substitute for B_H)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()
    return nbytes / _median_time(buf.sum, repeats)


def measure_pair_costs(pool: ExpertPool, act, device, tokens: int = 64, repeats: int = 3) -> tuple[float, float]:
    """Seconds per extra (token, expert) pair on the CPU path and on the device: one expert run on
    ``tokens`` tokens against one token (the weight read cancels out). The device side reads slot 0,
    which the link measurement has filled; (cpu, 0.0) without slots."""
    x = torch.randn(tokens, pool.hidden).to(pool.dtype)
    ones = torch.ones(tokens, 1)
    blocks = pool.layer_blocks(pool.moe_layer_ids[0])

    def per_pair(run) -> float:
        run(tokens)
        small, big = _median_time(lambda: run(1), repeats), _median_time(lambda: run(tokens), repeats)
        return max(big - small, 0.0) / (tokens - 1)

    def cpu(n: int) -> None:
        routed_partial_sum(x[:n], pool.gate_up, pool.down, torch.zeros(n, 1, dtype=torch.long), ones[:n], act,
                           blocks)

    if device.num_slots > 0:  # slot 0 holds a real expert (timings of garbage weights can differ)
        device.copy_async([0], [0]).wait()

    def dev(n: int) -> None:
        device.compute(x[:n], torch.zeros(n, 1, dtype=torch.long), ones[:n], act, blocks)
        device.synchronize()

    return per_pair(cpu), (per_pair(dev) if device.num_slots > 0 else 0.0)
