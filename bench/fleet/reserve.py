"""The reservations phase: creates that start now, watched until active, and their latencies read
back from the database (commit times of the lifecycle events)."""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import grpc
import psycopg

from bench.creates import MIX, error_label
from bench.fleet.options import PROGRESS_SECONDS, RPC_TIMEOUT, TENANT, say
from bench.fleet.start import Seeded, heartbeat_age_s
from bettercompute.v1 import events_pb2, events_pb2_grpc, reservations_pb2_grpc
from bettercompute.v1 import reservations_pb2 as r

@dataclass
class Created:
    number: int
    rid: str = ""
    state: str = ""
    answered: float = 0.0  # time.monotonic() when the Create answer arrived
    seconds: float = 0.0  # the Create call's own latency


def create_request(seeded_pool: str, run_id: str, number: int) -> r.CreateReservationRequest:
    rng = random.Random(f"fleet/{number}")
    gpus = rng.choices([g for g, _ in MIX], weights=[w for _, w in MIX])[0]
    return r.CreateReservationRequest(  # no start: the window begins now
        tenant_id=TENANT, pool_id=seeded_pool, duration="1h", idempotency_key=f"{run_id}-{number:06d}",
        devices=[r.DeviceRequest(device_class="gpu", count=gpus)])


async def watch_active(endpoint: str, token: str, after_id: int, seen: dict[str, float]) -> None:
    """Events.Watch of the tenant's reservation.active events: when this client heard of each."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = events_pb2_grpc.EventsStub(channel)
        call = stub.Watch(events_pb2.WatchRequest(tenant_id=TENANT, after_id=after_id,
                                                  types=["reservation.active"]),
                          metadata=(("authorization", f"Bearer {token}"),))
        async for event in call:
            seen.setdefault(event.subject.removeprefix("reservation/"), time.monotonic())


def active_count(conninfo: str, ids: list[str]) -> int:
    with psycopg.connect(conninfo) as conn:
        return conn.execute("SELECT count(DISTINCT subject) FROM events WHERE type = 'reservation.active'"
                            " AND subject = ANY(%s)", ([f"reservation/{i}" for i in ids],)).fetchone()[0]


async def create_all(endpoint: str, token: str, pool_id: str, run_id: str, count: int,
                     concurrency: int, rate: float) -> list[Created]:
    """`count` creates, `concurrency` in flight; with `rate`, call n starts no earlier than n / rate."""
    results: list[Created] = []
    numbers = iter(range(count))
    md = (("authorization", f"Bearer {token}"),)
    started = time.monotonic()
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub = reservations_pb2_grpc.ReservationsStub(channel)

        async def worker() -> None:
            for number in numbers:
                if rate:
                    await asyncio.sleep(max(0.0, started + number / rate - time.monotonic()))
                made = Created(number)
                t0 = time.monotonic()
                try:
                    reply = await stub.Create(create_request(pool_id, run_id, number), metadata=md, timeout=RPC_TIMEOUT)
                    made.rid, made.state = reply.id, reply.state or "(no state)"
                except grpc.aio.AioRpcError as exc:
                    made.state = error_label(exc)
                made.answered = time.monotonic()
                made.seconds = made.answered - t0
                results.append(made)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


@dataclass
class Latencies:
    created: list[Created]
    create_seconds: float
    active_within: int
    waited_seconds: float
    # seconds per reservation, from the commit times of the events (database clock)
    placed_active: list[float] = field(default_factory=list)
    # the same from the events' `time` column: the start of each transaction
    placed_active_starts: list[float] = field(default_factory=list)
    placed_binding: list[float] = field(default_factory=list)
    binding_report: list[float] = field(default_factory=list)
    report_active: list[float] = field(default_factory=list)
    # seconds per reservation: Create answered -> Events.Watch delivered reservation.active
    client: list[float] = field(default_factory=list)
    states: list[tuple[str, int]] = field(default_factory=list)
    # (seconds since the first placed event, placed, binding, active) per bucket
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    timeline_step: float = 1.0
    worst_heartbeat_age: float = 0.0  # seconds, sampled while the reservations ran
    other_events: list[tuple[str, int]] = field(default_factory=list)
    # time.time() when the phase began and ended (the log lines of bench.fleet.stages)
    began_at: float = 0.0
    ended_at: float = 0.0


def db_latencies(conninfo: str, ids: list[str], out: Latencies) -> None:
    subjects = [f"reservation/{i}" for i in ids]
    with psycopg.connect(conninfo) as conn:
        # Each event row's commit time (its inserting transaction's), and its `time` column:
        # compute_now() is now(), the start of that transaction. A report's commit time is lost
        # (the worker updates the row when it judges it): received_at is the start of the
        # gateway's short intake transaction.
        rows = conn.execute(
            "SELECT subject, type, extract(epoch FROM pg_xact_commit_timestamp(xmin))::float,"
            " extract(epoch FROM time)::float FROM events WHERE subject = ANY(%s) ORDER BY id", (subjects,)).fetchall()
        reports = dict(conn.execute(
            "SELECT 'reservation/' || a.reservation_id,"
            " extract(epoch FROM min(nr.received_at))::float"
            " FROM node_reports nr JOIN allocations a ON a.id = nr.allocation_id"
            " WHERE a.reservation_id = ANY(%s) AND nr.kind = 'bound' GROUP BY 1", (ids,)).fetchall())
        out.states = [tuple(x) for x in conn.execute(
            "SELECT state, count(*) FROM reservations WHERE id = ANY(%s) GROUP BY 1 ORDER BY 2 DESC", (ids,))]
    first: dict[str, dict[str, float]] = {}
    started: dict[str, dict[str, float]] = {}
    other: Counter[str] = Counter()
    for subject, type_, committed, began in rows:
        first.setdefault(subject, {}).setdefault(type_, committed)
        started.setdefault(subject, {}).setdefault(type_, began)
        if type_ not in ("reservation.placed", "reservation.binding", "reservation.active"):
            other[type_] += 1
    out.other_events = other.most_common()
    kinds = ("reservation.placed", "reservation.binding", "reservation.active")
    stamps = [(t, at) for _, t, at, _ in rows if t in kinds]
    if stamps:
        origin = min(at for _, at in stamps)
        span = max(at for _, at in stamps) - origin
        step = 1.0 if span <= 15 else 5.0 if span <= 90 else 10.0
        buckets: dict[int, Counter[str]] = {}
        for t, at in stamps:
            buckets.setdefault(int((at - origin) // step), Counter())[t] += 1
        out.timeline_step = step
        out.timeline = [(i * step, *(buckets.get(i, Counter())[k] for k in kinds))
                        for i in range(int(span // step) + 1)]
    for subject in subjects:
        times = first.get(subject, {})
        placed, binding, active = (times.get(f"reservation.{k}") for k in ("placed", "binding", "active"))
        report = reports.get(subject)
        if placed is not None and active is not None:
            out.placed_active.append(active - placed)
        began = started.get(subject, {})
        if "reservation.placed" in began and "reservation.active" in began:
            out.placed_active_starts.append(began["reservation.active"] - began["reservation.placed"])
        if placed is not None and binding is not None:
            out.placed_binding.append(binding - placed)
        if binding is not None and report is not None:
            out.binding_report.append(report - binding)
        if report is not None and active is not None:
            out.report_active.append(active - report)


async def reservations_phase(args: argparse.Namespace, endpoint: str, conninfo: str, seeded: Seeded) -> Latencies:
    with psycopg.connect(conninfo) as conn:
        after_id = conn.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
    seen: dict[str, float] = {}
    began_at = time.time()
    watcher = asyncio.create_task(watch_active(endpoint, seeded.token, after_id, seen))
    run_id = f"fleet-{uuid.uuid4().hex[:10]}"
    pace = f", paced at {args.rate:g}/s" if args.rate else ""
    say(f"creating {args.reservations} reservations (start now, 1 h, 1/2/4/8 GPUs), "
        f"{args.concurrency} in flight{pace}")
    t0 = time.monotonic()
    creating = asyncio.create_task(create_all(endpoint, seeded.token, seeded.pool_id, run_id, args.reservations,
                                              args.concurrency, args.rate))
    worst_age = 0.0
    while not creating.done():
        await asyncio.wait({creating}, timeout=PROGRESS_SECONDS)
        worst_age = max(worst_age, await asyncio.to_thread(heartbeat_age_s, conninfo, seeded.pool_id) or 0.0)
        if not creating.done():
            say(f"  creates: {time.monotonic() - t0:.0f}s, {len(seen)} active (seen on Watch)")
    created = creating.result()
    create_seconds = time.monotonic() - t0
    placed = [c.rid for c in created if c.rid and c.state in ("placed", "binding", "active")]
    say(f"  creates: {len(created)} answered in {create_seconds:.1f}s; waiting up to {args.active_timeout:.0f}s "
        f"for {len(placed)} to be active")
    deadline = time.monotonic() + args.active_timeout
    last_progress = time.monotonic()
    active = 0
    while True:
        active = await asyncio.to_thread(active_count, conninfo, placed)
        if active >= len(placed) or time.monotonic() >= deadline:
            break
        if time.monotonic() - last_progress >= PROGRESS_SECONDS:
            worst_age = max(worst_age, await asyncio.to_thread(heartbeat_age_s, conninfo, seeded.pool_id) or 0.0)
            say(f"  {active}/{len(placed)} active")
            last_progress = time.monotonic()
        await asyncio.sleep(0.5)
    waited = time.monotonic() - t0
    # The stream trails the commit a little: give it a moment to deliver the last events.
    settle = time.monotonic() + 5.0
    while not watcher.done() and sum(1 for i in placed if i in seen) < active and time.monotonic() < settle:
        await asyncio.sleep(0.1)
    watcher.cancel()
    (ended,) = await asyncio.gather(watcher, return_exceptions=True)
    if isinstance(ended, grpc.aio.AioRpcError):
        say(f"  note: Events.Watch failed ({ended.code().name}: {ended.details()}); the client-side row is partial")
    out = Latencies(created, create_seconds, active, waited, worst_heartbeat_age=worst_age,
                    began_at=began_at, ended_at=time.time())
    await asyncio.to_thread(db_latencies, conninfo, placed, out)
    out.client = [seen[c.rid] - c.answered for c in created if c.rid in seen]
    return out
