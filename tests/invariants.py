"""The invariants of the booking store, recomputed in SQL from the rows in one REPEATABLE READ
snapshot, without trusting the EXCLUDE constraint or the quota code. Shared by the concurrency,
property and chaos tests."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import psycopg
from psycopg import IsolationLevel

from controlplane.reservations import states

CHARGING = frozenset({states.PENDING, states.QUEUED}) | states.BOOKED
ENDED = frozenset({states.RELEASED, states.CANCELLED, states.FAILED, states.EXPIRED})


# The invariants, recomputed in SQL ---------------------------------------------------------

DOUBLE_BOOKED = """
SELECT b1.atom_id, b1.allocation_id AS allocation_1, b1.during::text AS during_1,
       b2.allocation_id AS allocation_2, b2.during::text AS during_2
FROM bookings b1
JOIN bookings b2 ON b2.atom_id = b1.atom_id AND b2.ctid <> b1.ctid AND b2.during && b1.during
JOIN atoms a ON a.id = b1.atom_id
JOIN nodes n ON n.id = a.node_id
JOIN pools p ON p.id = n.pool_id
WHERE p.owner_tenant_id = %(t)s
"""

# An idempotency key is its creator's, even after the reservation was reassigned (offboarding).
KEYS = """
SELECT coalesce(creator_identity_id, owner_identity_id) AS creator, idempotency_key, count(*)::int
FROM reservations WHERE tenant_id = %(t)s GROUP BY 1, 2
"""

# `count` is every GPU the reservation books: per node times the gang's size (1 without a gang).
CHARGES = """
SELECT r.id, r.state,
       (r.request #>> '{devices,0,count}')::int * coalesce((r.request #>> '{gang,size}')::int, 1) AS count,
       coalesce(sum(c.amount) FILTER (WHERE c.refunded_at IS NULL AND c.resource = 'gpu'), 0)::int AS live,
       count(c.*) FILTER (WHERE c.refunded_at IS NULL AND c.resource = 'gpu')::int AS live_rows
FROM reservations r LEFT JOIN quota_charges c ON c.reservation_id = r.id
WHERE r.tenant_id = %(t)s
GROUP BY r.id
"""

USED = """
SELECT coalesce((SELECT sum(amount) FROM quota_charges
                 WHERE tenant_id = %(t)s AND resource = 'gpu' AND refunded_at IS NULL), 0)::int AS used,
       coalesce((SELECT "limit" FROM quotas WHERE tenant_id = %(t)s AND resource = 'gpu'), 0)::int AS limit
"""

# The running usage (migration 0029) against the sum of live charges, per resource and
# denominator: rows where they differ.
USAGE_DRIFT = """
SELECT coalesce(u.resource, c.resource) AS resource, coalesce(u.per, c.per) AS per,
       coalesce(u.amount, 0) AS kept, coalesce(c.amount, 0) AS summed
FROM (SELECT resource, per, amount FROM quota_usage WHERE tenant_id = %(t)s) u
FULL JOIN (SELECT resource, per, sum(amount) AS amount FROM quota_charges
           WHERE tenant_id = %(t)s AND refunded_at IS NULL GROUP BY resource, per) c
       ON c.resource = u.resource AND c.per = u.per
WHERE coalesce(u.amount, 0) <> coalesce(c.amount, 0)
"""

# Per reservation: the bookings of its live allocations, and of all of them, recomputed from rows.
BOOKINGS = """
SELECT r.id, r.state, r.pool_id,
       (r.request #>> '{devices,0,count}')::int * coalesce((r.request #>> '{gang,size}')::int, 1) AS count,
       coalesce((r.request #>> '{gang,size}')::int, 1) AS size,
       r.request #>> '{gang,topologyKey}' AS gang_key,
       r.request #>> '{devices,0,topology}' AS topology,
       r.request ->> 'binding' AS binding,
       count(b.atom_id) FILTER (WHERE live)::int AS bookings,
       count(b.atom_id) FILTER (WHERE live AND at.kind = 'gpu')::int AS gpu_bookings,
       count(b.atom_id) FILTER (WHERE live AND NOT b.during <@ r.during)::int AS outside_window,
       count(DISTINCT b.atom_id) FILTER (WHERE live)::int AS atoms,
       count(DISTINCT an.id) FILTER (WHERE live)::int AS nodes,
       count(DISTINCT (a.id, at.nvlink_domain)) FILTER (WHERE live)::int AS domains,
       coalesce(bool_or(at.nvlink_domain = '') FILTER (WHERE live), false) AS outside_domain,
       count(DISTINCT (a.id, at.numa_node)) FILTER (WHERE live)::int AS numa_nodes,
       count(DISTINCT a.gang_group) FILTER (WHERE live)::int AS gang_groups,
       count(DISTINCT an.labels -> (r.request #>> '{gang,topologyKey}') ->> 'value')
           FILTER (WHERE live)::int AS label_values,
       coalesce(bool_or(an.labels -> (r.request #>> '{gang,topologyKey}') ->> 'value' IS DISTINCT FROM a.gang_group)
           FILTER (WHERE live AND r.request #>> '{gang,topologyKey}' <> ''), false) AS off_group,
       count(b.atom_id) FILTER (WHERE live AND b.during <> r.during)::int AS off_window,
       count(b.atom_id) FILTER (WHERE an.id <> a.node_id OR an.pool_id <> r.pool_id)::int AS elsewhere,
       count(b.atom_id) FILTER (
           WHERE upper(b.during) > r.updated_at + (SELECT offset_ms FROM clock) * interval '1 millisecond'
       )::int AS past_end,
       count(b.atom_id)::int AS all_bookings,
       count(DISTINCT a.id) FILTER (WHERE live)::int AS live_allocations
FROM reservations r
LEFT JOIN LATERAL (
    SELECT a.*, a.state IN ('placed', 'binding', 'bound') AS live FROM allocations a WHERE a.reservation_id = r.id
) a ON true
LEFT JOIN bookings b ON b.allocation_id = a.id
LEFT JOIN atoms at ON at.id = b.atom_id
LEFT JOIN nodes an ON an.id = at.node_id
WHERE r.tenant_id = %(t)s
GROUP BY r.id
"""

EVENTS = """
SELECT substr(subject, length('reservation/') + 1) AS id, type, data->>'state' AS state
FROM events
WHERE tenant_id = %(t)s AND type LIKE 'reservation.%%' AND subject LIKE 'reservation/%%'
ORDER BY events.id
"""


def snapshot(conninfo: str, tenant: str) -> dict[str, list[dict[str, Any]]]:
    """Everything the invariants need, read in one consistent snapshot."""
    with psycopg.connect(conninfo, row_factory=psycopg.rows.dict_row) as conn:
        conn.isolation_level = IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        with conn.transaction():
            params = {"t": tenant}
            return {name: conn.execute(sql, params).fetchall() for name, sql in (
                ("double_booked", DOUBLE_BOOKED), ("keys", KEYS), ("charges", CHARGES), ("used", USED), ("usage_drift", USAGE_DRIFT),
                ("bookings", BOOKINGS), ("events", EVENTS),
            )}


def transition_violations(rows: list[dict[str, Any]], current: dict[str, str]) -> list[str]:
    """Each reservation's events, in order, must walk the state table from draft one allowed step
    at a time, and end in the reservation's current state."""
    seen: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for e in rows:
        seen[e["id"]].append((e["type"], e["state"]))
    problems = []
    for rid, state_now in current.items():
        prev = states.DRAFT
        for type_, state in seen.get(rid, []):
            suffix = type_.removeprefix("reservation.")
            if suffix in states.TRANSITIONS and suffix != state:
                problems.append(f"{rid}: event {type_} carries state {state!r}")
            # extended, repaired and the like report a change within a state, not a transition.
            within_state = suffix not in states.TRANSITIONS and state == prev
            if not within_state and state not in states.TRANSITIONS.get(prev, frozenset()):
                problems.append(f"{rid}: {prev} -> {state} ({type_}) is not in TRANSITIONS; "
                                f"events: {seen[rid]}")
            prev = state
        # The event catalog has no reservation.denied: a refusal is answered, not announced.
        refused = state_now == states.DENIED and prev in (states.DRAFT, states.AWAITING_CONFIRMATION)
        if prev != state_now and not refused:
            problems.append(f"{rid}: is {state_now} but its last event says {prev}; events: {seen.get(rid)}")
    return problems


def check_invariants(conninfo: str, tenant: str) -> dict[str, list[dict[str, Any]]]:
    s = snapshot(conninfo, tenant)
    assert s["double_booked"] == [], f"atoms double-booked: {s['double_booked']}"
    assert all(k["count"] == 1 for k in s["keys"]), s["keys"]

    used, limit = s["used"][0]["used"], s["used"][0]["limit"]
    wrong_charges = [
        c for c in s["charges"]
        if (c["live"], c["live_rows"]) != ((c["count"], 1) if c["state"] in CHARGING else (0, 0))
    ]
    assert wrong_charges == [], f"live charges do not match the states: {wrong_charges}"
    charged = sum(c["count"] for c in s["charges"] if c["state"] in CHARGING)
    assert used == charged, f"quota used {used} != {charged}, the GPUs of pending/placed reservations"
    assert used <= limit, f"quota used {used} exceeds the limit {limit}"
    assert s["usage_drift"] == [], f"the running quota usage differs from the live charges: {s['usage_drift']}"

    for b in s["bookings"]:
        where = f"reservation {b['id']} ({b['state']}): {b}"
        assert b["elsewhere"] == 0, "bookings are on the allocation's node, in the pool; " + where
        if b["state"] in states.BOOKED:
            if b["binding"] == "node":  # whole machines: every bookable atom, some joined later (0033)
                assert b["gpu_bookings"] >= b["count"] and b["bookings"] == b["atoms"], \
                    "a node lease books at least its machines' GPUs, each atom once; " + where
                assert b["outside_window"] == 0, "a node lease's bookings lie in its window; " + where
            else:
                assert b["bookings"] == b["count"] == b["atoms"], "a placed one books exactly count atoms; " + where
                assert b["off_window"] == 0, "bookings cover the reservation's window; " + where
            assert b["nodes"] == b["size"] and b["live_allocations"] == b["size"], \
                "one allocation per node, every member of a gang; " + where
            if b["topology"] == "nvlink-all":
                assert b["domains"] == b["size"] and not b["outside_domain"], "nvlink-all in one domain; " + where
            if b["topology"] == "numa":
                assert b["numa_nodes"] == b["size"], "numa on one NUMA node; " + where
            if b["size"] > 1:
                assert b["gang_groups"] == 1 and not b["off_group"], "a gang's members share one value; " + where
                if b["gang_key"]:
                    assert b["label_values"] == 1, "a gang's members share one label value; " + where
        elif b["state"] in ENDED:
            assert b["past_end"] == 0, "an ended reservation keeps no booking past its end; " + where
            assert b["live_allocations"] == 0, where
        else:  # draft, awaiting-confirmation, denied, pending, queued: nothing booked now
            # A reservation sent back to pending (a failed bind or repair) keeps the history of
            # the bookings it held until then, truncated at that moment, and nothing beyond it.
            assert b["past_end"] == 0 and b["live_allocations"] == 0, where
            if b["state"] in (states.DRAFT, states.AWAITING_CONFIRMATION, states.DENIED):
                assert b["all_bookings"] == 0, where

    current = {b["id"]: b["state"] for b in s["bookings"]}
    problems = transition_violations(s["events"], current)
    assert problems == [], "\n".join(problems)
    return s
