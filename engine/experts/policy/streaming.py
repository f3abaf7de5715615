"""When a step should stream whole expert layers rather than take the decode path (a policy over
measured costs; the streaming itself is ``mechanism/streamer.py``)."""

from __future__ import annotations

from hearth.engine.experts.policy.qstar import SplitCosts, best_q


def expected_distinct(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer routes ``tokens`` tokens to (uniform routing)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def stream_min_tokens(costs: SplitCosts, num_experts: int, top_k: int, resident: float, max_tokens: int) -> int:
    """The smallest step size (tokens) for which streaming whole layers is expected to be faster
    per layer than the decode path; ``max_tokens + 1`` when it never is.

    Streaming moves the layer's non-resident experts and overlaps that with computing every pair on
    the device: ``max(E·(1 − r)·S / B_P, pairs·c_dev)``. The decode path splits the expected
    misses by the q table, fills before computing, and computes the CPU's pairs on the CPU:
    ``max(q·S / B_P, (m − q)·S / B_R + cpu pairs·c_cpu) + device pairs·c_dev``. ``r`` is the
    resident share of a layer's experts; ``c_dev`` and ``c_cpu`` are the measured per-pair compute
    costs of the two paths."""
    if costs.link is None or costs.link.bytes_per_s <= 0:
        return max_tokens + 1
    size = costs.expert_bytes
    stream_copy = costs.link.seconds(num_experts * (1.0 - resident) * size)
    qs = [best_q(costs, m) for m in range(num_experts + 1)]
    for tokens in range(1, max_tokens + 1):
        pairs = tokens * top_k
        distinct = expected_distinct(num_experts, top_k, tokens)
        misses = round(distinct * (1.0 - resident))
        q = qs[misses]
        cpu_pairs = pairs * (misses - q) / max(distinct, 1.0)
        fill = costs.link.seconds(q * size)
        cpu = 0.0
        if misses > q and costs.cpu is not None:
            cpu = costs.cpu.seconds((misses - q) * size) + cpu_pairs * costs.cpu_pair_s
        decode = max(fill, cpu) + (pairs - cpu_pairs) * costs.device_pair_s
        stream = max(stream_copy, pairs * costs.device_pair_s)
        if stream <= decode:
            return tokens
    return max_tokens + 1
