"""When a node heartbeats: on its own grid of one period, from a random phase, each beat moved later
by up to `jitter` of the period.

The grid is what keeps a fleet on one event loop spread out. Timing each beat from when the last
one went out (`now + period`) lets any stall of the loop gather every beat that fell due during
it into a burst, and keeps the burst together from then on: the N beats of a one-second stall go
out together, each next one is due `period` after that same moment, and the burst's own cost
stalls the loop again and gathers more. On a grid, beats delayed by a stall go out late once and
fall back to their own places; the jitter keeps nodes whose sessions started together from
beating together.
"""

from __future__ import annotations

import random

JITTER = 0.1  # a beat comes up to this fraction of the period after its grid point


class Beats:
    def __init__(self, period: float, now: float, jitter: float = JITTER, rng: random.Random | None = None) -> None:
        if period <= 0 or not 0 <= jitter < 0.5:
            raise ValueError("the period must be positive and the jitter within [0, 0.5)")
        self.period, self.jitter = period, jitter
        self._rng = rng or random.Random()
        self._grid = now + self._rng.uniform(0, period)  # the first beat: anywhere in the first period
        self.due = self._grid

    def sent(self, now: float) -> float:
        """A beat went out at `now` (on time, late, or out of turn): when the next one is due.

        The next grid point after `now`, skipping one less than half a period away (a late beat
        is not followed at once by an on-time one), plus the jitter: consecutive beats are between
        half a period and 1.5 + `jitter` periods apart, whatever the loop did meanwhile."""
        while self._grid <= now + self.period / 2:
            self._grid += self.period
        self.due = self._grid + self._rng.uniform(0, self.jitter) * self.period
        return self.due
