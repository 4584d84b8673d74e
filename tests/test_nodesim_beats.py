"""nodesim's heartbeat schedule (nodesim.beats): bounded jitter, a fleet spread over the period, and
beats that a stall of the event loop delayed going back to their own places instead of staying
together."""

from __future__ import annotations

import random

import pytest

from nodesim.beats import Beats

PERIOD = 5.0


def _fleet(count: int, now: float, jitter: float = 0.1) -> list[Beats]:
    rng = random.Random(12)
    return [Beats(PERIOD, now, jitter, rng) for _ in range(count)]


def _buckets(times: list[float], buckets: int = 10) -> list[int]:
    counts = [0] * buckets
    for t in times:
        counts[int((t % PERIOD) / PERIOD * buckets)] += 1
    return counts


def test_beats_on_time_stay_within_the_jitter() -> None:
    beats = Beats(PERIOD, 100.0, 0.1, random.Random(1))
    assert 100.0 <= beats.due <= 100.0 + PERIOD
    gaps = []
    for _ in range(1000):
        before = beats.due
        gaps.append(beats.sent(before) - before)  # each beat goes out exactly when due
    assert min(gaps) >= PERIOD * 0.9 and max(gaps) <= PERIOD * 1.1
    assert max(gaps) - min(gaps) > PERIOD * 0.1  # the jitter is used, not a fixed period


def test_no_jitter_is_a_fixed_period() -> None:
    beats = Beats(PERIOD, 0.0, 0.0, random.Random(1))
    first = beats.due
    for n in range(1, 50):
        assert beats.sent(beats.due) == pytest.approx(first + n * PERIOD)


def test_a_fleet_starting_together_is_spread_over_the_period() -> None:
    fleet = _fleet(5000, now=0.0)
    counts = _buckets([b.due for b in fleet])
    assert min(counts) > 350 and max(counts) < 650  # 500 a bucket, give or take


def test_beats_gathered_by_a_stall_go_back_to_their_places() -> None:
    fleet = _fleet(5000, now=0.0)
    for b in fleet:  # every beat runs on time for a while
        for _ in range(3):
            b.sent(b.due)
    before = _buckets([b.due for b in fleet])
    stall_end = max(b.due for b in fleet)  # the loop stopped for a whole period: every beat is late
    for b in fleet:
        b.sent(stall_end)  # ...and all of them go out together when it comes back
    after = _buckets([b.due for b in fleet])
    assert min(after) > 350 and max(after) < 650, after  # spread again, not one burst
    assert sum(abs(x - y) for x, y in zip(before, after, strict=True)) < 500  # each in its own place


def test_a_late_or_extra_beat_is_never_followed_at_once() -> None:
    rng = random.Random(3)
    beats = Beats(PERIOD, 0.0, 0.1, rng)
    now = 0.0
    for _ in range(2000):
        # Sent on time, late by up to two periods, or out of turn (an applied generation).
        now = max(now, beats.due + rng.choice([0.0, rng.uniform(0, 2 * PERIOD), -rng.uniform(0, PERIOD)]))
        gap = beats.sent(now) - now
        assert PERIOD / 2 < gap <= PERIOD * 1.6


@pytest.mark.parametrize("jitter", [-0.1, 0.5, 1.0])
def test_jitter_out_of_range_is_refused(jitter: float) -> None:
    with pytest.raises(ValueError):
        Beats(PERIOD, 0.0, jitter)
