"""Live estimates of B_P (link) and B_H (host expert path) from a replica's own timings.

The engine's expert backend keeps cumulative counters of bytes, seconds and calls for fills
and for CPU experts (``HierarchicalExpertBackend.stats``). The tracker turns the difference
between two readings into one rate sample per path — bytes over the time left after each call's
fixed dispatch cost, so small batches do not read as a slow link — keeps the last ``window``
samples, and takes their median, so one slow interval (a page fault storm, a noisy neighbour)
does not move the table. When the median drifts from the bandwidths behind the current q table
by more than ``drift``, :meth:`BandwidthTracker.observe` returns the new pair; the caller pushes it
to the replica actor, whose engine rebuilds the q table in place at a step boundary.

Pure Python, no Ray: the monitor actor and the tests drive the same class.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MonitorPolicy:
    """``window`` samples per path; a sample needs ``min_calls`` calls in its interval; a new table
    is pushed when either median moves more than ``drift`` (relative) from the current one."""

    window: int = 7
    min_calls: int = 4
    min_samples: int = 3
    drift: float = 0.15


@dataclass(frozen=True)
class BandwidthChange:
    """A pair of estimates that moved past the threshold: push it to the replica actor."""

    b_p: float
    b_h: float
    previous: tuple[float, float]

    def describe(self) -> str:
        (p0, h0) = self.previous
        return (f"B_P {p0 / 1e9:.2f} -> {self.b_p / 1e9:.2f} GB/s, "
                f"B_H {h0 / 1e9:.2f} -> {self.b_h / 1e9:.2f} GB/s")


class _PathSamples:
    """Rate samples of one path from the deltas of its (bytes, seconds, calls) counters."""

    def __init__(self, prefix: str, fixed_key: str, window: int) -> None:
        self.prefix, self.fixed_key = prefix, fixed_key
        self.samples: deque[float] = deque(maxlen=window)
        self.last: tuple[float, float, float] | None = None

    def observe(self, stats: dict[str, Any], min_calls: int) -> None:
        now = (float(stats[f"{self.prefix}_bytes"]), float(stats[f"{self.prefix}_seconds"]),
               float(stats[f"{self.prefix}_calls"]))
        last, self.last = self.last, now
        if last is None:
            return
        d_bytes, d_seconds, d_calls = (a - b for a, b in zip(now, last, strict=True))
        if d_calls < min_calls or d_bytes <= 0:
            return  # too little work in this interval to say anything (or the counters were reset)
        busy = d_seconds - d_calls * float(stats.get(self.fixed_key, 0.0))
        if busy > 0:
            self.samples.append(d_bytes / busy)

    def median(self, min_samples: int) -> float | None:
        return statistics.median(self.samples) if len(self.samples) >= min_samples else None


class BandwidthTracker:
    """Tracks (B_P, B_H) for one replica, starting from the pair behind its current table."""

    def __init__(self, b_p: float, b_h: float, policy: MonitorPolicy | None = None) -> None:
        self.policy = policy or MonitorPolicy()
        self.current = (b_p, b_h)
        self.link = _PathSamples("fill", "link_fixed_s", self.policy.window)
        self.host = _PathSamples("cpu", "cpu_fixed_s", self.policy.window)
        self.changes = 0

    def observe(self, stats: dict[str, Any]) -> BandwidthChange | None:
        """Feed one reading of the backend's cumulative stats; a change to push, or None."""
        self.link.observe(stats, self.policy.min_calls)
        self.host.observe(stats, self.policy.min_calls)
        return self._check()

    def add_probe(self, b_p: float | None, b_h: float | None) -> BandwidthChange | None:
        """Add the result of an idle probe (either may be None: not measured)."""
        if b_p:
            self.link.samples.append(b_p)
        if b_h:
            self.host.samples.append(b_h)
        return self._check()

    def estimate(self) -> tuple[float, float]:
        """The current medians, falling back to the table's values for a path without samples."""
        n = self.policy.min_samples
        b_p, b_h = self.link.median(n), self.host.median(n)
        return (b_p if b_p is not None else self.current[0], b_h if b_h is not None else self.current[1])

    def _check(self) -> BandwidthChange | None:
        est = self.estimate()
        moved = any(abs(new - old) > self.policy.drift * old for new, old in zip(est, self.current, strict=True))
        if not moved:
            return None
        change = BandwidthChange(est[0], est[1], self.current)
        self.current = est
        self.changes += 1
        return change
