"""Identifiers, request hashing and durations (DESIGN.md sections 4 and 5)."""

from __future__ import annotations

import base64
import hashlib
import re
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import errors
from controlplane.durations import parse_duration_ms
from controlplane.ids import b32, draft_id, new_id, request_hash
from controlplane.reservations.validate import validate_create

DRAFT_ID = re.compile(r"^rsv_[0-9a-hjkmnp-tv-z]{52}$")
NEW_ID = re.compile(r"^(?P<prefix>[a-z]+)_[0-9a-hjkmnp-tv-z]{26}$")
CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"

TEXT = st.text(min_size=0, max_size=40)
KEY = st.text(alphabet="ABCXYZabcxyz0189._:-", min_size=1, max_size=40)  # idempotency keys


def _decode(body: str) -> int:
    n = 0
    for ch in body:
        n = n * 32 + CROCKFORD.index(ch)
    return n


# Draft ids -----------------------------------------------------------------------------


@given(TEXT, TEXT, KEY)
def test_draft_id_is_rsv_and_52_lowercase_crockford_characters(tenant: str, identity: str, key: str) -> None:
    assert DRAFT_ID.match(draft_id(tenant, identity, key))


# Golden vectors, from the definition (DESIGN.md section 5, spec 000 "Drafts and idempotency"):
# rsv_ + lowercase Crockford base32 of SHA-256 over the tenant, the identity and the key, each
# UTF-8 with a 4-byte big-endian length in front. The reference below is written from that text
# with the standard library's RFC 4648 base32, translated to Crockford's alphabet; it shares no
# code with controlplane.ids.
RFC4648 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
TO_CROCKFORD = str.maketrans(RFC4648, CROCKFORD)


def reference_draft_id(tenant: str, identity: str, key: str) -> str:
    parts = [part.encode("utf-8") for part in (tenant, identity, key)]
    encoded = b"".join(struct.pack(">I", len(raw)) + raw for raw in parts)
    digest = hashlib.sha256(encoded).digest()
    return "rsv_" + base64.b32encode(digest).decode("ascii").rstrip("=").translate(TO_CROCKFORD)


@pytest.mark.parametrize(
    "tenant, identity, key, expected",
    [
        ("acme", "user-alice", "train-2026-01", "rsv_78ret210h7saw51mbzv9357aj7388m2sy1vxyxn45fn77x7jsrbg"),
        ("", "", "", "rsv_2qp7qw5n0wsb97w253g7t91pacwfkrxbk55g1br8wphvzzjnzp5g"),
        ("t", "i", "k", "rsv_ezzmjcjqdd121w0gqva66t63nesmb94fv2kbhkh1085swypwgzxg"),
        ("tenant-\u00fc", "ident", "key:1", "rsv_gtzwwm0kmscqvq44bbpr913rvmxcfszzcbc37mzhh8fwpfqvz6v0"),
    ],
)
def test_draft_id_matches_golden_vectors(tenant: str, identity: str, key: str, expected: str) -> None:
    assert reference_draft_id(tenant, identity, key) == expected
    assert draft_id(tenant, identity, key) == expected


@given(TEXT, TEXT, KEY)
def test_draft_id_is_the_definition(tenant: str, identity: str, key: str) -> None:
    assert draft_id(tenant, identity, key) == reference_draft_id(tenant, identity, key)


@given(st.tuples(TEXT, TEXT, KEY), st.tuples(TEXT, TEXT, KEY))
def test_draft_id_differs_when_tenant_identity_or_key_differ(
    a: tuple[str, str, str], b: tuple[str, str, str]
) -> None:
    if a != b:
        assert draft_id(*a) != draft_id(*b)


@pytest.mark.parametrize(
    "a, b",
    [
        (("ab", "c", "k"), ("a", "bc", "k")),
        (("a", "bc", "k"), ("a", "b", "ck")),
        (("", "abc", "k"), ("abc", "", "k")),
        (("t", "i", "1k"), ("t", "i1", "k")),
        (("t\x00", "i", "k"), ("t", "\x00i", "k")),
    ],
)
def test_draft_id_is_unambiguous_where_concatenations_coincide(
    a: tuple[str, str, str], b: tuple[str, str, str]
) -> None:
    assert "".join(a) == "".join(b)
    assert draft_id(*a) != draft_id(*b)


def test_draft_id_differs_in_each_component() -> None:
    base = draft_id("tenant", "identity", "key")
    assert len({base, draft_id("tenant2", "identity", "key"), draft_id("tenant", "identity2", "key"),
                draft_id("tenant", "identity", "key2")}) == 4


# Generated ids -------------------------------------------------------------------------


@given(st.sampled_from(["pool", "node", "alloc", "rgrant", "pacct", "prj", "hold", "evt"]))
def test_new_id_is_prefix_and_26_lowercase_crockford_characters(prefix: str) -> None:
    value = new_id(prefix)
    m = NEW_ID.match(value)
    assert m is not None, value
    assert m["prefix"] == prefix


def test_new_id_carries_the_current_time_in_milliseconds() -> None:
    before = int(time.time() * 1000)
    value = new_id("evt")
    after = int(time.time() * 1000)
    n = _decode(value.split("_", 1)[1])  # 130 bits: 48 of ms, 80 random, 2 of padding
    ms = n >> (80 + 2)
    assert before <= ms <= after


def test_new_ids_sort_in_time_order() -> None:
    values = []
    for _ in range(20):
        values.append(new_id("evt"))
        time.sleep(0.002)  # a new millisecond: ordering within one millisecond is random
    assert values == sorted(values)


def test_new_ids_do_not_repeat() -> None:
    values = [new_id("alloc") for _ in range(5000)]
    assert len(set(values)) == len(values)


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=16, max_size=16))
def test_b32_preserves_byte_order(a: bytes, b: bytes) -> None:
    assert (a < b) == (b32(a) < b32(b))


@given(st.binary(min_size=0, max_size=40))
def test_b32_round_trips(data: bytes) -> None:
    encoded = b32(data)
    assert len(encoded) == (len(data) * 8 + 4) // 5
    assert set(encoded) <= set(CROCKFORD)
    pad = (5 - len(data) * 8 % 5) % 5
    assert _decode(encoded) >> pad == int.from_bytes(data, "big") if data else encoded == ""


def _b32_bit_by_bit(data: bytes) -> str:
    """The encoding as first written (five bits at a time): stored ids depend on every character."""
    bits = len(data) * 8
    n = int.from_bytes(data, "big") << ((5 - bits % 5) % 5)
    return "".join(CROCKFORD[(n >> (5 * i)) & 31] for i in reversed(range((bits + 4) // 5)))


@given(st.binary(min_size=0, max_size=64))
def test_b32_writes_exactly_the_characters_it_always_wrote(data: bytes) -> None:
    assert b32(data) == _b32_bit_by_bit(data)


# Request hash --------------------------------------------------------------------------

JSON_LEAF = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=12,
)


def _reordered(value, rnd):  # type: ignore[no-untyped-def]
    """The same value with every dict's keys inserted in another order."""
    if isinstance(value, dict):
        keys = list(value)
        rnd.shuffle(keys)
        return {k: _reordered(value[k], rnd) for k in keys}
    if isinstance(value, list):
        return [_reordered(v, rnd) for v in value]
    return value


@settings(max_examples=60)
@given(st.dictionaries(st.text(max_size=6), JSON, max_size=8), st.randoms(use_true_random=False))
def test_request_hash_does_not_depend_on_key_order(request: dict, rnd) -> None:  # type: ignore[no-untyped-def]
    assert request_hash(request) == request_hash(_reordered(request, rnd))


@settings(max_examples=60)
@given(st.dictionaries(st.text(max_size=6), JSON, min_size=1, max_size=8), st.data())
def test_request_hash_changes_when_a_value_changes(request: dict, data: st.DataObject) -> None:
    key = data.draw(st.sampled_from(sorted(request)))
    assert request_hash({**request, key: [request[key]]}) != request_hash(request)


POOL = "pool_" + "0" * 26


def _raw(**kw):  # type: ignore[no-untyped-def]
    raw = {"tenant_id": "t1", "pool_id": POOL, "idempotency_key": "k1",
           "devices": [{"class": "gpu", "count": 2, "topology": "", "model": ""}],
           "duration": "8h", "duration_ms": None, "binding": "", "start": None,
           "wait_timeout_ms": None, "lease_seconds": None, "node_selector": {}}
    raw.update(kw)
    return raw


def test_request_hash_is_of_the_normalised_request() -> None:
    """Durations in ms, binding defaulted to hold, topology to any: equal requests hash equal;
    wait and the idempotency key are not part of the hash."""
    base = request_hash(validate_create(_raw()).request)
    same = [
        _raw(duration=None, duration_ms=28_800_000),
        _raw(duration="480m"),
        _raw(binding="hold"),
        _raw(devices=[{"class": "gpu", "count": 2, "topology": "any", "model": ""}]),
        _raw(wait_timeout_ms=5000),
        _raw(idempotency_key="another-key"),
        _raw(node_selector={}),
    ]
    for raw in same:
        assert request_hash(validate_create(raw).request) == base, raw
    different = [
        _raw(duration="9h"),
        _raw(devices=[{"class": "gpu", "count": 3, "topology": "", "model": ""}]),
        _raw(devices=[{"class": "gpu", "count": 2, "topology": "nvlink-all", "model": ""}]),
        _raw(start=1_900_000_000_000),
        _raw(node_selector={"rack": "r1"}),
        _raw(lease_seconds=600),
    ]
    for raw in different:
        assert request_hash(validate_create(raw).request) != base, raw


def test_request_hash_matches_a_golden_vector() -> None:
    """SHA-256 (hex) of the canonical JSON of the normalised request: keys sorted, no spaces,
    durations in ms, binding hold, topology any, every optional key present."""
    canonical = ('{"binding":"hold","devices":[{"class":"gpu","count":2,"model":"","topology":"any"}],'
                 '"durationMs":28800000,"leaseSeconds":null,"nodeSelector":{},"poolId":"' + POOL + '","start":null}')
    expected = "6e353c24b2bc3ce90ed78f18e0c4acfccd9457f7f6486d484a0ae44047688450"
    assert hashlib.sha256(canonical.encode("utf-8")).hexdigest() == expected
    assert request_hash(validate_create(_raw()).request) == expected


def test_request_hash_ignores_node_selector_insertion_order() -> None:
    a = validate_create(_raw(node_selector={"rack": "r1", "zone": "z1"})).request
    b = validate_create(_raw(node_selector={"zone": "z1", "rack": "r1"})).request
    assert request_hash(a) == request_hash(b)


# Durations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, ms",
    [("8h", 28_800_000), ("90m", 5_400_000), ("3d", 259_200_000), ("7200s", 7_200_000),
     ("250ms", 250), ("7200000", 7_200_000)],
)
def test_duration_parses(text: str, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("text", ["", "h", "-1h", "1.5h", "8 hours", "8hh", "ms", "h8", "0x10", "1e3"])
def test_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration_ms(text)


@pytest.mark.parametrize("text", ["", "h", "-1h", "1.5h", "8 hours"])
def test_create_rejects_a_bad_duration_as_invalid_input_naming_the_field(text: str) -> None:
    with pytest.raises(errors.InvalidInput) as excinfo:
        validate_create(_raw(duration=text))
    assert excinfo.value.details["field"] == "duration"


@given(st.integers(0, 10**9), st.sampled_from([("ms", 1), ("s", 1000), ("m", 60_000), ("h", 3_600_000),
                                               ("d", 86_400_000), ("", 1)]))
def test_duration_is_number_times_unit(n: int, unit: tuple[str, int]) -> None:
    assert parse_duration_ms(f"{n}{unit[0]}") == n * unit[1]
