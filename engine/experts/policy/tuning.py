"""Online tuning of the fill credit: the q table's one free choice, settled by measured step time.

The q table (``qstar.py``) is optimal for one step: it minimises the exposed time of this step's
misses. A filled expert, though, keeps paying off while it stays cached, and a CPU-computed one
does not; how much that future is worth depends on the workload's locality and the cache size,
which no start-up profile knows. With strong locality and a large cache, filling every miss builds
a better cache and wins; with weak locality the per-step table wins by 2× or more; and where the
CPU alone is nearly as fast as the link, keeping the link idle so the CPU gets all of B_H can be
best. The table therefore takes a *fill credit* (seconds subtracted per fill, in units of one
expert's CPU time ``S / B_H``) and this tuner picks the credit by measurement.

:class:`CreditTuner` is a hill climber over an ordered ladder of credits, from "never fill" through
the per-step table (credit 0) to "fill every miss". It holds a credit for ``hold`` epochs, then
probes a neighbouring rung for ``probe`` epochs; it moves when the probe's last epoch was faster
than the latest epoch before it by more than ``margin``, and otherwise goes back and tries the
other side next time, waiting ever longer before retrying a failed side. A probe that ties looks
one rung further before deciding (neighbouring credits often give the same table). A probe
towards fewer fills that is clearly worse ends after a quarter of an epoch; one towards more fills
always runs its length, since fills cost first and pay later. Only rungs next to a good one are
tried, so a slow extreme costs little. It is pure bookkeeping: the caller feeds measured expert
seconds and rebuilds the table when :attr:`credit` changes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The credit ladder, in units of S / B_H (one expert's CPU time): -inf never fills, 0 is the
# per-step optimum, inf fills every miss.
CREDIT_LADDER = (-math.inf, 0.0, 0.25, 0.5, 1.0, math.inf)
# Decode tokens per measured epoch: one epoch is this many tokens' worth of MoE layer calls.
TUNER_EPOCH_TOKENS = 4


@dataclass
class CreditTuner:
    """Picks a rung of ``ladder`` by measured seconds per epoch (see the module docstring).

    ``epoch_calls`` is how many decode layer calls one epoch measures."""

    epoch_calls: int
    ladder: tuple[float, ...] = CREDIT_LADDER
    hold: int = 8
    probe: int = 2
    margin: float = 0.02
    max_backoff: int = 16
    abort: float = 0.25
    index: int = field(default=-1)
    _home: int = field(default=-1, init=False)  # the rung a probe returns to
    _home_cost: float = field(default=math.inf, init=False)
    _epochs_left: int = field(default=0, init=False)
    _direction: int = field(default=1, init=False)
    _backoff: dict[int, int] = field(default_factory=dict, init=False)  # direction -> hold multiplier
    _seconds: float = field(default=0.0, init=False)
    _calls: int = field(default=0, init=False)
    moves: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.epoch_calls < 1:
            raise ValueError("epoch_calls must be at least 1")
        if self.index < 0:
            self.index = self.ladder.index(0.0)
        self._home = self.index
        self._epochs_left = self.hold

    @property
    def credit(self) -> float:
        """The current credit in units of ``S / B_H``."""
        return self.ladder[self.index]

    @property
    def probing(self) -> bool:
        return self.index != self._home

    def observe(self, seconds: float, calls: int = 1) -> bool:
        """Feed the measured expert seconds of ``calls`` decode layer calls; True when
        :attr:`credit` changed (rebuild the q table)."""
        self._seconds += seconds
        self._calls += calls
        cost = self._seconds / self._calls
        # A probe towards fewer fills that is clearly worse after a quarter of an epoch ends at
        # once: fewer fills save now and cost later, so its first calls are its best case, and a
        # slow extreme (never filling with strong locality is 5-10x slower) then costs one token.
        # A probe towards more fills costs first and pays later: it always runs its full length.
        clearly_worse = self.probing and self.index < self._home and self._calls * 4 >= self.epoch_calls \
            and cost > self._home_cost * (1.0 + self.abort)
        if self._calls < self.epoch_calls and not clearly_worse:
            return False
        self._seconds, self._calls = 0.0, 0
        self._epochs_left = 0 if clearly_worse else self._epochs_left - 1
        if self._epochs_left > 0:
            if not self.probing:
                self._home_cost = cost  # the latest home epoch is what a probe is judged against
            return False
        before = self.index
        if self.probing:
            self._end_probe(cost)
        else:
            self._home_cost = cost
            self._start_probe()
        return self.index != before

    def _start_probe(self) -> None:
        target = self._home + self._direction
        if not 0 <= target < len(self.ladder):
            self._direction = -self._direction
            target = self._home + self._direction
        self.index = target
        self._epochs_left = self.probe

    def _end_probe(self, cost: float) -> None:
        further = self.index + self._direction
        if cost < self._home_cost * (1.0 + self.margin) and 0 <= further < len(self.ladder) \
                and cost >= self._home_cost * (1.0 - self.margin):
            # A plateau: no clear answer, so look one rung further the same way before deciding.
            self.index = further
            self._epochs_left = self.probe
            return
        if cost < self._home_cost * (1.0 - self.margin):
            self._home, self._home_cost = self.index, cost  # keep climbing the same way next time
            self._backoff.clear()
            self.moves += 1
        else:
            self.index = self._home
            # A failed direction is retried ever more rarely (the workload may change, so never
            # never); the other side is tried next.
            self._backoff[self._direction] = min(2 * self._backoff.get(self._direction, 1), self.max_backoff)
            self._direction = -self._direction
        self._epochs_left = self.hold * self._backoff.get(self._direction, 1)
