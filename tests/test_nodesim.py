"""nodesim (the FakeDaemon) over real TLS on loopback: enrolment, the mutual-TLS session, Hello,
convergence to the files of DESIGN.md §11, node-signed reports, recovery and every fault flag.

Most tests run against the real gateway and control plane (`real_stack`; states reached through
the API and the reservation worker, run on demand). Six keep the test peer
(tests/nodesim_peer.py), each for something the real gateway cannot be made to send; a comment
above each says what.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.v1 import reservations_pb2 as pb_api
from nodesim import cdischema
from nodesim.config import parse_args
from nodesim.fleet import Fleet
from nodesim.inventory import gpu_uuid
from tests.nodesim_peer import PURPOSE, Peer, PeerNode, assignment, eventually

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
HOUR_MS = 3_600_000
# CDI naming (container-device-interface pkg/parser): kind is vendor/class.
CDI_KIND = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]/[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]$")
CDI_DEVICE_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.:-]*$")


def cdi_problems(text: str) -> list[str]:
    """Why a CDI spec file is invalid: not JSON, or what nodesim/cdischema.py finds; [] when valid."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        return [f"not JSON: {exc}"]
    return cdischema.problems(document)


def now_ms() -> int:
    return int(time.time() * 1000)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def simulated(
    tmp: Path, names: list[str], *flags: str, peer: Peer | None = None, connect: bool = True
) -> AsyncIterator[tuple[Peer, Fleet]]:
    """A peer (unless given) and a fleet of `names` with `flags`; both stopped on the way out."""
    own_peer = peer is None
    if peer is None:
        peer = Peer()
        await peer.start()
    fleet = Fleet(parse_args([*peer.args(tmp, names, tmp / "sandbox"), "--heartbeat", "0.2", *flags]))
    try:
        await fleet.start()
        if connect:
            await fleet.wait_connected(timeout=15)
            await eventually(lambda: all(peer.by_name(n).hellos for n in names if _known(peer, n)), 10)
        yield peer, fleet
    finally:
        await fleet.stop()
        if own_peer:
            await peer.stop()


@contextlib.asynccontextmanager
async def real_stack(
    database: str, tmp: Path, names: list[str], *flags: str, connect: bool = True
) -> AsyncIterator[tuple[Any, Any, Fleet]]:
    """The real gateway and control plane (workers on demand: ControlPlane.drain) on one database,
    and a fleet of `names` enrolled into the control plane's pool with join tokens: connected, its
    Hellos taken in, unless `connect` is False."""
    from tests.nodes_support import ControlPlane
    from tests.test_gateway import GatewayThread, join_token

    gateway = await asyncio.to_thread(GatewayThread, database, every_beat())
    cp = await asyncio.to_thread(ControlPlane, database)
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tokens = tmp / "tokens.json"
        entries = [{"name": n, "joinToken": await asyncio.to_thread(join_token, database, cp.pool_id, n)}
                   for n in names]
        tokens.write_text(json.dumps(entries))
        ca = tmp / "ca.pem"
        ca.write_bytes(gateway.ca_pem)
        args = ["--sim", str(len(names)), "--gateway", gateway.endpoint, "--enrol-gateway", gateway.enrol_endpoint,
                "--sandbox", str(tmp / "sandbox"), "--tokens", str(tokens), "--ca", str(ca), "--heartbeat", "0.2"]
        async with Fleet(parse_args([*args, *flags])) as fleet:
            if not connect:
                yield gateway, cp, fleet
                return
            await fleet.wait_connected(timeout=30)
            # ...and the gateway has taken in every Hello (atoms and all).
            await rows(database, "SELECT 1 FROM nodes WHERE pool_id = %s AND daemon_version <> ''"
                                 " AND connectivity = 'connected' HAVING count(*) = %s", cp.pool_id, len(names))
            # ...and the control plane's capacity index has them (the pool's per-GPU host share,
            # which a create books, comes from it): the Hello's rows commit in one transaction.
            await asyncio.to_thread(cp.server.call, cp.server.app.runtime.capacity.barrier())
            yield gateway, cp, fleet
    finally:
        await asyncio.to_thread(cp.stop)
        await asyncio.to_thread(gateway.stop)


async def rows(database: str, query: str, *params: object, timeout: float = 30) -> list[dict]:
    """The rows of `query` once there are some (the gateway and the fleet work on their own schedule)."""
    from tests.test_pki import sql

    deadline = time.monotonic() + timeout
    while not (found := await asyncio.to_thread(sql, database, query, params)):
        assert time.monotonic() < deadline, f"no rows: {query} {params}"
        await asyncio.sleep(0.05)
    return found


async def reports_of(database: str, allocation_id: str, kind: str, count: int = 1) -> list[pb.Report]:
    """The node's stored reports of `kind` about the allocation, once there are `count` of them."""
    from tests.test_pki import sql

    query = "SELECT body FROM node_reports WHERE allocation_id = %s AND kind = %s ORDER BY id"
    deadline = time.monotonic() + 30
    while len(found := await asyncio.to_thread(sql, database, query, (allocation_id, kind))) < count:
        assert time.monotonic() < deadline, f"{len(found)} of {count} {kind} reports about {allocation_id}"
        await asyncio.sleep(0.05)
    return [pb.Report.FromString(bytes(r["body"])) for r in found]


async def binding_through_the_api(cp: Any, count: int = 1, limits: dict | None = None) -> Any:
    """A reservation created through the API, moved to binding by the worker; the node hears of it."""
    from tests.test_gateway import set_limits

    created = await asyncio.to_thread(cp.create, count=count)
    if limits is not None:  # no API asks for limits yet: the one column is written directly
        await asyncio.to_thread(set_limits, cp.conninfo, created.allocations[-1].id, limits)
    await asyncio.to_thread(cp.drain)
    current = await asyncio.to_thread(cp.get, created.id)
    # A quick node's report may already have been judged in the same drain.
    assert current.state in ("binding", "active"), current
    return current


async def applied_in_db(database: str, node_id: str) -> int:
    """Until the gateway has the node's heartbeat saying it applied its current desired generation."""
    [row] = await rows(database, "SELECT desired_generation FROM nodes WHERE id = %s"
                                 " AND applied_generation = desired_generation", node_id)
    return row["desired_generation"]


def every_beat() -> Any:
    """Gateway settings under which every heartbeat moves `last_seen` (what heard_again watches)."""
    from gateway.config import GatewaySettings

    return GatewaySettings(node_seen_write_fraction=0)


async def heard_again(database: str, node_ids: list[str], times: int = 2) -> None:
    """Until the gateway has seen each of the nodes (a heartbeat) `times` more times."""
    from tests.test_pki import sql

    query = "SELECT id, last_seen FROM nodes WHERE id = ANY(%s)"
    seen = {r["id"]: r["last_seen"] for r in await asyncio.to_thread(sql, database, query, (node_ids,))}
    for _ in range(times):
        deadline = time.monotonic() + 30
        while True:
            now = {r["id"]: r["last_seen"] for r in await asyncio.to_thread(sql, database, query, (node_ids,))}
            if all(now[k] is not None and (seen[k] is None or now[k] > seen[k]) for k in node_ids):
                break
            assert time.monotonic() < deadline, "no heartbeats"
            await asyncio.sleep(0.05)
        seen = now


def _known(peer: Peer, name: str) -> bool:
    return any(n.name == name for n in peer.nodes.values())


def gpus(node: PeerNode) -> list[str]:
    return [g.uuid for g in node.hellos[-1].inventory.gpus]


def sandbox(tmp: Path, name: str) -> Path:
    return tmp / "sandbox" / name


def artefact_paths(root: Path, alloc: str) -> tuple[Path, Path, Path]:
    return (
        root / "etc" / "cdi" / f"bcd-{alloc}.json",
        root / "run" / "bcd" / "allocations" / f"{alloc}.env",
        root / "sys" / "fs" / "cgroup" / "bcd.slice" / f"bcd-alloc-{alloc}.slice",
    )


def env_lines(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


async def applied(node: PeerNode, generation: int) -> None:
    """Until the node's heartbeat says it applied `generation`: the reports that applying it made
    were written to the stream before that heartbeat, so whatever is not in by now never came."""
    await eventually(lambda: any(h.applied_generation == generation for h in node.heartbeats))


def bound_ids(node: PeerNode, verdict: str | None = "ok") -> list[str]:
    return [r.bound.allocation_id for r in node.events("bound", verdict)]


# -- enrolment, session, Hello ----------------------------------------------------------------


def test_enrols_with_a_csr_then_opens_a_mutual_tls_session_and_says_hello(database: str, tmp_path: Path) -> None:
    names = ["sim-000", "sim-001", "sim-002"]

    async def scenario() -> None:
        async with real_stack(database, tmp_path, names, "--fabric-size", "2") as (gateway, cp, fleet):
            domains = {}
            for name in names:
                sim = fleet.node(name)
                assert sim.sessions == 1
                [node] = await rows(database, "SELECT * FROM nodes WHERE name = %s AND pool_id = %s"
                                              " AND connectivity = 'connected'", name, cp.pool_id)
                assert sim.node_id == node["id"]
                assert node["daemon_version"] == "nodesim-1.0.0"
                assert node["capabilities"] == ["binding.kubernetes", "binding.node", "devices.limits"]
                inv = node["inventory"]
                assert [g["uuid"] for g in inv["gpus"]] == [gpu_uuid(name, i) for i in range(8)]
                assert all(re.fullmatch(r"GPU-[0-9a-f-]{36}", g["uuid"]) for g in inv["gpus"])
                assert {(g["model"], g["memory_mib"], g["mig_mode"]) for g in inv["gpus"]} == {
                    ("H100-SXM5-80GB", 81559, False)}
                assert [g["numa_node"] for g in inv["gpus"]] == [0, 0, 0, 0, 1, 1, 1, 1]
                assert [(n["id"], n["cpulist"]) for n in inv["numa_nodes"]] == [
                    (0, "0-47,96-143"), (1, "48-95,144-191")]
                assert inv["vcpus"] == 192 and inv["memory_bytes"] == 2048 * GIB and inv["isolated_cpus"] == ""
                assert sum(n["memory_bytes"] for n in inv["numa_nodes"]) == inv["memory_bytes"]
                assert inv["hugepages_1gi"] > 0
                atoms = await rows(database, "SELECT device_uuid, nvlink_domain FROM atoms WHERE node_id = %s"
                                             " ORDER BY device_uuid", node["id"])
                assert len(atoms) == 8 and len({a["nvlink_domain"] for a in atoms}) == 1
                domain = atoms[0]["nvlink_domain"]
                assert domain and node["labels"]["fabric.domain"]["value"] == domain
                domains[name] = atoms[0]["nvlink_domain"]

                # Keys and certificates on disk: keys 0600; the client certificate names the node id.
                bcd = sandbox(tmp_path, name) / "var" / "lib" / "bcd"
                for key in ("node.key", "tls.key"):
                    assert stat.S_IMODE((bcd / key).stat().st_mode) == 0o600
                cert = x509.load_pem_x509_certificate((bcd / "node.crt").read_bytes())
                assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node["id"]
                assert (bcd / "node-id").read_text().strip() == node["id"]
                assert (bcd / "ca.crt").read_bytes() == gateway.ca_pem
            # One NVLink cluster per two nodes of the fleet.
            assert domains["sim-000"] == domains["sim-001"] != domains["sim-002"]
            # Heartbeats flow at the configured period: the gateway sees each node again and again.
            query = "SELECT id, last_seen FROM nodes WHERE pool_id = %s"
            seen = {r["id"]: r["last_seen"] for r in await rows(database, query, cp.pool_id)}
            for _ in range(2):
                deadline = time.monotonic() + 30
                while True:
                    now = {r["id"]: r["last_seen"] for r in await rows(database, query, cp.pool_id)}
                    if all(now[k] > seen[k] for k in seen):
                        break
                    assert time.monotonic() < deadline, "no heartbeats"
                    await asyncio.sleep(0.05)
                seen = now

    run(scenario())


def test_a_restarted_fleet_reuses_its_keys_and_certificates(database: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"]) as (_, cp, fleet):
            key_id = fleet.node("sim-000").identity.key_id  # type: ignore[union-attr]
            node_id = fleet.node("sim-000").node_id
            [first] = await rows(database, "SELECT session_id FROM nodes WHERE id = %s AND session_id IS NOT NULL",
                                 node_id)
            await fleet.stop()
            # The same tokens file, its token spent: the gateway refuses it, only the stored identity works.
            async with Fleet(fleet.config) as again:
                await again.wait_connected(timeout=30)
                assert again.node("sim-000").identity.key_id == key_id  # type: ignore[union-attr]
                assert again.node("sim-000").node_id == node_id
                await rows(database, "SELECT 1 FROM nodes WHERE id = %s AND session_id IS NOT NULL"
                                     " AND session_id <> %s", node_id, first["session_id"])
                assert len(await rows(database, "SELECT id FROM nodes WHERE pool_id = %s", cp.pool_id)) == 1

    run(scenario())


# -- convergence ------------------------------------------------------------------------------


def test_a_limited_hold_writes_the_cdi_spec_env_file_and_cgroup_slice_at_their_paths(
    database: str, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"]) as (_, cp, fleet):
            node_id = fleet.node("sim-000").node_id
            limits = {"cpu_millis": 2500, "memory_bytes": 64 * GIB, "hugepages_1gi": 2, "cpus": "48-59,144-155",
                      "mems": "1"}
            r = await binding_through_the_api(cp, count=2, limits=limits)
            alloc = r.allocations[-1].id
            devices = list(r.allocations[-1].device_ids)
            index = {gpu_uuid("sim-000", i): i for i in range(8)}
            [bound] = await reports_of(database, alloc, "bound")

            root = sandbox(tmp_path, "sim-000")
            spec_path, env_path, slice_dir = artefact_paths(root, alloc)
            spec = json.loads(spec_path.read_text())
            assert spec["cdiVersion"] == "0.6.0" and spec["kind"] == "bcd.dev/gpu"
            assert [d["name"] for d in spec["devices"]] == devices
            assert [d["containerEdits"]["deviceNodes"] for d in spec["devices"]] == [
                [{"path": f"/dev/nvidia{index[d]}"}] for d in devices
            ]
            assert {"path": "/dev/nvidiactl"} in spec["containerEdits"]["deviceNodes"]
            assert spec["annotations"]["bcd.dev/cgroup-parent"] == f"bcd-alloc-{alloc}.slice"
            assert spec["annotations"]["bcd.dev/binding"] == "hold"
            spec_env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
            assert spec_env["NVIDIA_VISIBLE_DEVICES"] == ",".join(devices)

            env = env_lines(env_path)
            assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(devices)
            assert env["BCD_ALLOCATION_ID"] == alloc
            assert env["BCD_UNTIL"] == str(r.during.end)
            assert env["BCD_CGROUP_PARENT"] == f"bcd-alloc-{alloc}.slice"

            files = {p.name: p.read_text() for p in slice_dir.iterdir()}
            assert files == {
                "cpu.max": "250000 100000\n",
                "memory.max": f"{64 * GIB}\n",
                "cpuset.cpus": "48-59,144-155\n",
                "cpuset.mems": "1\n",
                "hugetlb.1GB.max": f"{2 * GIB}\n",
            }
            # Written atomically: no temporary file is left anywhere.
            assert not [p for p in root.rglob("*") if ".tmp-" in p.name]

            assert list(bound.bound.cdi_devices) == [f"bcd.dev/gpu={d}" for d in devices]
            assert bound.bound.env_file == f"/run/bcd/allocations/{alloc}.env"
            assert bound.bound.cgroup_parent == f"bcd-alloc-{alloc}.slice"
            # The heartbeat says the node converged to that generation.
            assert await applied_in_db(database, node_id) > 0
            # ...and the worker takes the node's word for it: active, with this binding.
            await asyncio.to_thread(cp.drain)
            active = await asyncio.to_thread(cp.get, r.id)
            assert active.state == "active" and active.binding.cgroup_parent == f"bcd-alloc-{alloc}.slice"

    run(scenario())


# The test peer, not the real gateway: MIG and slot device classes (the gateway sends only whole GPUs)
# beside a limited kubernetes binding (tests/test_kubernetes_binding.py runs one end to end).
def test_unlimited_mig_slot_and_kubernetes_holds(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"], "--mig-gpus", "2") as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            assert [x.mig_mode for x in node.hellos[0].inventory.gpus] == [False] * 6 + [True] * 2
            limits = pb.Limits(cpu_millis=8000, memory_bytes=32 * GIB)
            peer.set_desired(
                node.node_id,
                [
                    assignment("alloc_plain", [g[0]]),
                    assignment("alloc_mig", [f"{g[6]}:0", f"{g[7]}:3"], device_class="gpu.mig"),
                    assignment("alloc_slot", [f"{g[1]}:0", f"{g[1]}:1"], device_class="gpu.slot"),
                    assignment("alloc_kube", [g[2]], binding=pb.BINDING_KUBERNETES, limits=limits),
                ],
            )
            await eventually(lambda: len(bound_ids(node)) == 4)
            root = sandbox(tmp_path, "sim-000")
            by_alloc = {r.bound.allocation_id: r.bound for r in node.events("bound")}

            spec, env, slice_dir = artefact_paths(root, "alloc_plain")
            plain = json.loads(spec.read_text())
            assert "bcd.dev/cgroup-parent" not in plain["annotations"] and not slice_dir.exists()
            assert "BCD_CGROUP_PARENT" not in env_lines(env) and by_alloc["alloc_plain"].cgroup_parent == ""

            mig = json.loads(artefact_paths(root, "alloc_mig")[0].read_text())
            assert mig["kind"] == "bcd.dev/gpu.mig"
            assert list(by_alloc["alloc_mig"].cdi_devices) == [f"bcd.dev/gpu.mig={g[6]}:0", f"bcd.dev/gpu.mig={g[7]}:3"]
            assert [d["containerEdits"]["deviceNodes"][0]["path"] for d in mig["devices"]] == [
                "/dev/nvidia6",
                "/dev/nvidia7",
            ]

            slot = json.loads(artefact_paths(root, "alloc_slot")[0].read_text())
            assert slot["kind"] == "bcd.dev/gpu.slot"
            assert list(by_alloc["alloc_slot"].cdi_devices) == [
                f"bcd.dev/gpu.slot={g[1]}:0",
                f"bcd.dev/gpu.slot={g[1]}:1",
            ]
            assert env_lines(artefact_paths(root, "alloc_slot")[1])["NVIDIA_VISIBLE_DEVICES"] == g[1]

            # Kubernetes: marked for the device plugin; no slice (the kubelet's cgroups hold its pods).
            kube_spec, kube_env, kube_slice = artefact_paths(root, "alloc_kube")
            kube = json.loads(kube_spec.read_text())
            assert kube["annotations"]["bcd.dev/binding"] == "kubernetes"
            assert "bcd.dev/cgroup-parent" not in kube["annotations"] and not kube_slice.exists()
            assert by_alloc["alloc_kube"].cgroup_parent == "" and "BCD_CGROUP_PARENT" not in env_lines(kube_env)

            for alloc in by_alloc:
                text = artefact_paths(root, alloc)[0].read_text()
                assert cdi_problems(text) == []
                document = json.loads(text)
                assert CDI_KIND.match(document["kind"])
                assert all(CDI_DEVICE_NAME.match(d["name"]) for d in document["devices"])

    run(scenario())


def test_written_cdi_specs_validate(database: str, tmp_path: Path) -> None:
    # The check looks into the container edits and the required fields (the examples of the
    # specification, and the agreement with its schema: tests/test_cdischema.py).
    assert cdi_problems("") != [] and cdi_problems("{}") != []
    missing_path = {
        "cdiVersion": "0.6.0",
        "kind": "a.b/c",
        "devices": [{"name": "x", "containerEdits": {"deviceNodes": [{}]}}],
    }
    assert cdi_problems(json.dumps(missing_path)) == ["$.devices[0].containerEdits.deviceNodes[0]: 'path' is required"]

    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"]) as (_, cp, _fleet):
            r = await binding_through_the_api(cp, count=4, limits={"cpu_millis": 1000, "memory_bytes": GIB})
            alloc = r.allocations[-1].id
            await reports_of(database, alloc, "bound")
            text = artefact_paths(sandbox(tmp_path, "sim-000"), alloc)[0].read_text()
            assert cdi_problems(text) == []
            document = json.loads(text)
            assert CDI_KIND.match(document["kind"])
            assert all(CDI_DEVICE_NAME.match(dev["name"]) for dev in document["devices"])
            assert all(isinstance(v, str) for v in document["annotations"].values())

    run(scenario())


# The test peer, not the real gateway: clashing, missing, oversized and unsafe assignments, which the
# control plane never makes.
def test_admission_refuses_missing_devices_clashes_and_memory_beyond_the_host(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            peer.set_desired(
                node.node_id,
                [
                    assignment("alloc_ok", [g[0]]),
                    assignment("alloc_clash", [g[0]]),
                    assignment("alloc_part", [f"{g[0]}:1"], device_class="gpu.slot"),
                    assignment("alloc_missing", ["GPU-00000000-0000-0000-0000-000000000000"]),
                    assignment("alloc_big", [g[1]], limits=pb.Limits(memory_bytes=4096 * GIB)),
                    assignment("alloc_pages", [g[2]], limits=pb.Limits(hugepages_1gi=100_000)),
                    assignment("../escape", [g[3]]),
                ],
            )
            await eventually(lambda: len(node.events("failed")) == 6)
            assert bound_ids(node) == ["alloc_ok"]
            failed = {r.failed.allocation_id: r.failed.reason for r in node.events("failed")}
            assert failed == {
                "alloc_clash": "resources-exhausted",
                "alloc_part": "resources-exhausted",
                "alloc_missing": "device-missing",
                "alloc_big": "resources-exhausted",
                "alloc_pages": "resources-exhausted",
                "../escape": "invalid-assignment",
            }
            root = sandbox(tmp_path, "sim-000")
            assert sorted(p.name for p in (root / "etc" / "cdi").iterdir()) == ["bcd-alloc_ok.json"]
            assert not (root / "etc" / "escape.json").exists() and not (tmp_path / "sandbox" / "escape.env").exists()
            # The same desired state again is not reported again.
            await applied(node, peer.set_desired(node.node_id, list(node.desired.assignments)))
            assert len(node.events("failed")) == 6 and len(node.events("bound")) == 1

    run(scenario())


# -- reports ----------------------------------------------------------------------------------


def test_reports_are_signed_by_the_node_key_over_the_purpose_prefix(database: str, tmp_path: Path) -> None:
    from controlplane.pki import attest

    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"]) as (_, cp, fleet):
            sim = fleet.node("sim-000")
            a, b = [await asyncio.to_thread(cp.create, count=1) for _ in range(2)]
            await asyncio.to_thread(cp.drain)  # both binding: the node binds and reports both
            await rows(database, "SELECT 1 FROM node_reports WHERE kind = 'bound' HAVING count(*) = 2")
            await asyncio.to_thread(cp.drain)
            assert {(await asyncio.to_thread(cp.get, r.id)).state for r in (a, b)} == {"active"}
            cp.world.user.res("Release", pb_api.ReleaseReservationRequest(tenant_id=cp.world.tenant,
                                                                          reservation_id=b.id))
            await asyncio.to_thread(cp.drain)  # the worker ends it; the node drops the hold and says so
            await rows(database, "SELECT 1 FROM node_reports WHERE kind = 'released' AND allocation_id = %s",
                       b.allocations[-1].id)

            bcd = sandbox(tmp_path, "sim-000") / "var" / "lib" / "bcd"
            cert = x509.load_pem_x509_certificate((bcd / "node.crt").read_bytes())
            key_id = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
            assert key_id == sim.identity.key_id  # type: ignore[union-attr]
            stored = await rows(database, "SELECT kind, body, key_id, signature FROM node_reports ORDER BY id")
            assert [r["kind"] for r in stored] == ["bound", "bound", "released"]
            sequences = []
            for row in stored:
                body = bytes(row["body"])
                assert row["key_id"] == key_id
                # Over the control plane's framing of a report (PURPOSE + body): raises if not.
                cert.public_key().verify(bytes(row["signature"]), attest.signed_message(body))
                assert attest.signed_message(body) == PURPOSE + body
                report = pb.Report.FromString(body)
                assert report.node_id == sim.node_id
                assert abs(report.time - now_ms()) < 60_000
                sequences.append(report.sequence)
            assert sequences == sorted(sequences) and len(set(sequences)) == len(sequences) == 3
            # Not over the body alone: the purpose prefix is part of what is signed.
            with pytest.raises(InvalidSignature):
                cert.public_key().verify(bytes(stored[0]["signature"]), bytes(stored[0]["body"]))
            await asyncio.to_thread(cp.drain)
            await asyncio.to_thread(cp.check_invariants)

    run(scenario())


# The test peer, not the real gateway: an `until` a few seconds ahead on the node's clock (a reservation's
# end is hours away, in the control plane's time).
def test_only_leaving_the_desired_state_releases_a_hold_never_the_end_of_until(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            limits = pb.Limits(cpu_millis=1000, memory_bytes=GIB)
            far = now_ms() + HOUR_MS
            peer.set_desired(node.node_id, [assignment("alloc_gone", [g[0]], far, limits=limits)])
            await eventually(lambda: bound_ids(node) == ["alloc_gone"])
            root = sandbox(tmp_path, "sim-000")
            assert all(p.exists() for p in artefact_paths(root, "alloc_gone"))

            peer.set_desired(node.node_id, [])
            await eventually(lambda: [r.released.allocation_id for r in node.events("released")] == ["alloc_gone"])
            assert node.events("released")[0].released.reason == "unassigned"
            assert not any(p.exists() for p in artefact_paths(root, "alloc_gone"))

            # `until` passes while the assignment is still desired: the node keeps the hold (the CDI
            # spec is the hold itself, and the node never drops one on its own)...
            until = now_ms() + 1500
            peer.set_desired(node.node_id, [assignment("alloc_ends", [g[1]], until, limits=limits)])
            await eventually(lambda: "alloc_ends" in bound_ids(node))
            await eventually(lambda: now_ms() > until + 1000, timeout=10)
            # A positive signal that the node is still running its loop past `until`: it applies a
            # newer desired state with the same assignment in it.
            await applied(node, peer.set_desired(node.node_id, list(node.desired.assignments)))
            assert len(node.events("released")) == 1
            assert all(p.exists() for p in artefact_paths(root, "alloc_ends"))
            # ...and drops it once the assignment leaves the desired state.
            peer.set_desired(node.node_id, [])
            await eventually(lambda: len(node.events("released")) == 2)
            ended = node.events("released")[1]
            assert (ended.released.allocation_id, ended.released.reason) == ("alloc_ends", "unassigned")
            assert not any(p.exists() for p in artefact_paths(root, "alloc_ends"))

    run(scenario())


def test_a_restarted_daemon_recovers_its_holds_from_the_sandbox_and_re_reports_them(
    database: str, tmp_path: Path
) -> None:
    from tests.test_pki import sql

    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"]) as (_, cp, fleet):
            node_id = fleet.node("sim-000").node_id
            limits = {"cpu_millis": 3000, "memory_bytes": 8 * GIB, "cpus": "0-2", "mems": "0"}
            r = await binding_through_the_api(cp, count=2, limits=limits)
            alloc = r.allocations[-1].id
            [first] = await reports_of(database, alloc, "bound")
            await fleet.stop()
            root = sandbox(tmp_path, "sim-000")
            before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and "var" not in p.parts}

            # A new process: nothing in memory; files and identity from the sandbox.
            async with Fleet(fleet.config) as again:
                await again.wait_connected(timeout=30)
                _, second = await reports_of(database, alloc, "bound", 2)
                assert second.bound == first.bound and second.sequence > first.sequence
                assert list(again.node("sim-000").converger.holds) == [alloc]
                # The desired state (unchanged) rewrites and re-reports nothing.
                generation = await applied_in_db(database, node_id)
                await asyncio.to_thread(sql, database, "SELECT bump_desired(%s)", (node_id,))
                await rows(database, "SELECT 1 FROM nodes WHERE id = %s AND applied_generation > %s",
                           node_id, generation)
                assert len(await reports_of(database, alloc, "bound", 2)) == 2
                after = {p: p.read_bytes() for p in root.rglob("*") if p.is_file() and "var" not in p.parts}
                assert after == before

    run(scenario())


def test_a_broken_stream_reconnects_and_re_reports_what_it_holds(database: str, tmp_path: Path) -> None:
    from tests.test_gateway import GatewayThread

    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"]) as (gateway, cp, fleet):
            sim = fleet.node("sim-000")
            r = await binding_through_the_api(cp)
            alloc = r.allocations[-1].id
            [first] = await reports_of(database, alloc, "bound")
            # The gateway restarts (on the same ports): its streams end; the node reconnects.
            await asyncio.to_thread(gateway.stop)
            again = await asyncio.to_thread(GatewayThread, database, listen=gateway.endpoint,
                                            enrol_listen=gateway.enrol_endpoint)
            try:
                _, second = await reports_of(database, alloc, "bound", 2)
                assert second.bound == first.bound and second.sequence > first.sequence
                await fleet.wait_connected(timeout=30)
                assert sim.sessions == 2 and fleet.node("sim-000") is sim  # the same process, a new session
            finally:
                await asyncio.to_thread(again.stop)

    run(scenario())


# The test peer, not the real gateway: a certificate already past half its life, and a renewal hint on demand.
def test_certificates_are_renewed_past_half_their_life_and_on_a_hint(tmp_path: Path) -> None:
    async def scenario() -> None:
        # The peer, not the real gateway: only it can hand out a certificate already 70 % through
        # its life, so renewal is due at once instead of after a wall-clock wait.
        peer = Peer(cert_lifetime=3600.0, enrol_aged=0.7)
        await peer.start()
        try:
            async with simulated(tmp_path, ["sim-000"], peer=peer) as (_, fleet):
                sim = fleet.node("sim-000")
                node = peer.by_name("sim-000")
                first = next(iter(node.signing_certs))  # the enrolment's attestation certificate
                # Past half its life: renewed over mTLS, a new session with the new certificate;
                # the renewed one is fresh, so once.
                await eventually(lambda: node.renewals == 1 and node.sessions == 2)
                current = sim.identity.key_id  # type: ignore[union-attr]
                assert current != first and current in node.signing_certs
                stored = x509.load_pem_x509_certificate((sim.store.dir / "node.crt").read_bytes())
                assert hashlib.sha256(stored.public_bytes(serialization.Encoding.DER)).hexdigest() == current
                # Reports go on verifying (verdict "ok") across renewals and the sessions they rotate.
                peer.set_desired(node.node_id, [assignment("alloc_new", gpus(node)[:1])])
                await eventually(lambda: "alloc_new" in bound_ids(node))
                assert {r.verdict for r in node.reports} == {"ok"}
                assert node.reports[-1].attested.key_id in node.signing_certs
        finally:
            await peer.stop()

        peer = Peer(cert_lifetime=3600.0)
        await peer.start()
        try:
            async with simulated(tmp_path / "hint", ["sim-000"], peer=peer) as (_, fleet):
                node = peer.by_name("sim-000")
                peer.renew_hint(node.node_id)
                await eventually(lambda: node.renewals == 1 and node.sessions == 2)
        finally:
            await peer.stop()

    run(scenario())


# -- faults -----------------------------------------------------------------------------------


# The test peer, not the real gateway: allocation ids chosen before the fleet starts (--fail-allocations)
# and 64 assignments at once.
def test_fail_allocations_and_fail_binds_report_resources_exhausted(tmp_path: Path) -> None:
    async def scenario() -> None:
        names = ["sim-000", "sim-001"]
        async with simulated(tmp_path, names, "--fail-allocations", "alloc_x", "--fault-nodes", "sim-000") as (peer, _):
            for name in names:
                node = peer.by_name(name)
                peer.set_desired(
                    node.node_id, [assignment("alloc_x", gpus(node)[:1]), assignment("alloc_y", gpus(node)[1:2])]
                )
            faulty, healthy = peer.by_name("sim-000"), peer.by_name("sim-001")
            await eventually(lambda: faulty.events("failed") and len(bound_ids(healthy)) == 2 and bound_ids(faulty))
            failure = faulty.events("failed")[0].failed
            assert (failure.allocation_id, failure.reason) == ("alloc_x", "resources-exhausted")
            assert bound_ids(faulty) == ["alloc_y"]
            assert not artefact_paths(sandbox(tmp_path, "sim-000"), "alloc_x")[0].exists()

        async with simulated(tmp_path / "all", ["sim-000"], "--fail-binds", "1") as (peer, _):
            node = peer.by_name("sim-000")
            peer.set_desired(node.node_id, [assignment(f"alloc_{i}", [g]) for i, g in enumerate(gpus(node))])
            await eventually(lambda: len(node.events("failed")) == 8)
            assert {r.failed.reason for r in node.events("failed")} == {"resources-exhausted"} and not bound_ids(node)

        async with simulated(
            tmp_path / "half", ["sim-000"], "--fail-binds", "0.5", "--gpus", "64", "--numa-nodes", "1"
        ) as (peer, _):
            node = peer.by_name("sim-000")
            peer.set_desired(node.node_id, [assignment(f"alloc_{i}", [g]) for i, g in enumerate(gpus(node))])
            await eventually(lambda: len(node.events("failed")) + len(bound_ids(node)) == 64)
            assert 16 <= len(node.events("failed")) <= 48

    run(scenario())


def test_never_answer_accepts_desired_state_but_never_reports(database: str, tmp_path: Path) -> None:
    from tests.test_pki import sql

    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"], "--never-answer") as (_, cp, fleet):
            node_id = fleet.node("sim-000").node_id
            r = await binding_through_the_api(cp)
            assert await applied_in_db(database, node_id) > 0  # it took the desired state in...
            # ...and two more heartbeats went by: anything it would have reported is behind us.
            await heard_again(database, [node_id])
            assert await asyncio.to_thread(sql, database, "SELECT 1 FROM node_reports") == []
            assert not artefact_paths(sandbox(tmp_path, "sim-000"), r.allocations[-1].id)[0].exists()

    run(scenario())


def test_unreachable_after_stops_the_session_and_heartbeats_but_keeps_the_holds(database: str, tmp_path: Path) -> None:
    from tests.test_pki import sql

    async def scenario() -> None:
        names = ["sim-000", "sim-001"]
        async with real_stack(
            database, tmp_path, names, "--unreachable-on-signal", "--fault-nodes", "sim-000"
        ) as (_, cp, fleet):
            ids = {n: fleet.node(n).node_id for n in names}
            # Eight GPUs each: one reservation fills a node, the next goes to the other.
            held = [await binding_through_the_api(cp, count=8) for _ in names]
            mine = next(r.allocations[-1].id for r in held if r.allocations[-1].node_id == ids["sim-000"])
            await reports_of(database, mine, "bound")
            fleet.go_unreachable()  # sim-001 has no such fault: only sim-000 goes
            await rows(database, "SELECT 1 FROM nodes WHERE id = %s AND session_id IS NULL", ids["sim-000"],
                       timeout=90)  # the gateway notices the silence on its own schedule
            [silent] = await asyncio.to_thread(sql, database, "SELECT last_seen FROM nodes WHERE id = %s",
                                               (ids["sim-000"],))
            # The other node heartbeats on while this one stays silent.
            await heard_again(database, [ids["sim-001"]], times=3)
            [now] = await asyncio.to_thread(sql, database, "SELECT last_seen, session_id FROM nodes WHERE id = %s",
                                            (ids["sim-000"],))
            assert now == {"last_seen": silent["last_seen"], "session_id": None}
            assert fleet.node("sim-000").state == "unreachable" and not fleet.node("sim-000").connected
            assert fleet.node("sim-000").sessions == 1
            assert artefact_paths(sandbox(tmp_path, "sim-000"), mine)[0].exists()
            assert fleet.node("sim-001").connected  # the other node is unaffected

    run(scenario())


def test_restart_after_drops_memory_reconnects_and_recovers_from_the_sandbox(database: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with real_stack(database, tmp_path, ["sim-000"], "--restart-on-signal") as (_, cp, fleet):
            before = fleet.node("sim-000")
            r = await binding_through_the_api(cp, count=2)
            alloc = r.allocations[-1].id
            [first] = await reports_of(database, alloc, "bound")
            assert fleet.restarts == 0
            fleet.restart_now()
            _, again = await reports_of(database, alloc, "bound", 2)
            assert fleet.restarts == 1 and fleet.node("sim-000") is not before
            assert again.sequence > first.sequence and again.bound == first.bound
            assert list(fleet.node("sim-000").converger.holds) == [alloc]
            await fleet.wait_connected(timeout=30)
            await asyncio.to_thread(cp.drain)
            assert (await asyncio.to_thread(cp.get, r.id)).state == "active"

    run(scenario())


def test_the_timed_unreachable_and_restart_faults_fire_no_sooner_than_asked(database: str, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with real_stack(database, tmp_path / "u", ["sim-000"], "--unreachable-after", "1",
                              connect=False) as (_, _cp, fleet):
            started = time.monotonic()  # the fleet has just started; its nodes' timers start after
            await eventually(lambda: "sim-000" in fleet.nodes and fleet.node("sim-000").state == "unreachable", 30)
            assert time.monotonic() - started >= 1.0 and fleet.node("sim-000").sessions <= 1
        async with real_stack(database, tmp_path / "r", ["sim-001"], "--restart-after", "1",
                              connect=False) as (_, _cp, fleet):
            started = time.monotonic()
            await eventually(lambda: fleet.restarts == 1, 30)
            assert time.monotonic() - started >= 1.0
            await fleet.wait_connected(timeout=30)

    run(scenario())


# The test peer, not the real gateway: limits and a kubernetes binding sent to a daemon without the
# capabilities (the control plane would not).
def test_no_capabilities_is_an_older_daemon_that_ignores_limits_and_kubernetes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"], "--no-capabilities") as (peer, _):
            node = peer.by_name("sim-000")
            hello = node.hellos[0]
            assert list(hello.capabilities) == [] and hello.daemon_version == "nodesim-0.8.0"
            limits = pb.Limits(cpu_millis=1000, memory_bytes=GIB)
            peer.set_desired(
                node.node_id, [assignment("alloc_old", gpus(node)[:1], binding=pb.BINDING_KUBERNETES, limits=limits)]
            )
            await eventually(lambda: bound_ids(node) == ["alloc_old"])
            spec, _, slice_dir = artefact_paths(sandbox(tmp_path, "sim-000"), "alloc_old")
            annotations = json.loads(spec.read_text())["annotations"]
            assert annotations["bcd.dev/binding"] == "hold" and "bcd.dev/cgroup-parent" not in annotations
            assert not slice_dir.exists() and node.events("bound")[0].bound.cgroup_parent == ""

    run(scenario())


@pytest.mark.parametrize("mode", ["unsigned", "foreign-key", "other-allocation", "other-node"])
def test_forged_reports(database: str, tmp_path: Path, mode: str) -> None:
    from structlog.testing import capture_logs

    from bettercompute.v1 import admin_pb2 as apb
    from tests.test_pki import sql

    async def scenario() -> None:
        names = ["sim-000", "sim-001"]
        async with real_stack(database, tmp_path, names, "--forge", mode, "--fault-nodes", "sim-000") as (_, cp, fleet):
            forger, honest = fleet.node("sim-000").node_id, fleet.node("sim-001").node_id

            async def on(node_id: str) -> Any:
                """A reservation bound to `node_id`: the other node is cordoned while it is placed."""
                other = honest if node_id == forger else forger
                def set_state(state: str) -> None:
                    cp.root.admin("SetNodeState", apb.SetNodeStateRequest(node_id=other, state=state))

                await asyncio.to_thread(set_state, "cordoned")
                try:
                    r = await binding_through_the_api(cp)
                finally:
                    await asyncio.to_thread(set_state, "ready")
                assert r.allocations[-1].node_id == node_id
                return r

            def ignored() -> list[dict]:
                key_id = fleet.node("sim-000").identity.key_id  # type: ignore[union-attr]
                return [e for e in logs if e["event"] == "report ignored" and e.get("key_id") == key_id]

            with capture_logs() as logs:
                theirs_r = await on(honest)
                theirs = theirs_r.allocations[-1].id
                await reports_of(database, theirs, "bound")
                mine = (await on(forger)).allocations[-1].id
                if mode in ("unsigned", "foreign-key"):
                    [report] = await reports_of(database, mine, "bound")
                    assert report.bound.allocation_id == mine
                    [row] = await rows(database, "SELECT key_id, signature FROM node_reports WHERE allocation_id = %s",
                                       mine)
                    if mode == "unsigned":
                        assert bytes(row["signature"]) == b"" and row["key_id"] == ""
                    else:  # the node's own key id, another key's signature
                        assert row["key_id"] == fleet.node("sim-000").identity.key_id  # type: ignore[union-attr]
                    await asyncio.to_thread(cp.drain)
                    [verdict] = await rows(database, "SELECT verdict FROM node_reports WHERE allocation_id = %s"
                                                     " AND judged_at IS NOT NULL", mine)
                    want = "unsigned report" if mode == "unsigned" else "bad signature"
                    assert verdict["verdict"] == f"rejected: {want}"
                else:
                    # A genuine signature over a report that is not "mine bound": about an allocation
                    # the forger does not hold (made up, or the honest node's), so the gateway drops it.
                    await eventually(lambda: ignored(), timeout=30)
                    assert await asyncio.to_thread(sql, database, "SELECT 1 FROM node_reports WHERE node_id = %s",
                                                   (forger,)) == []
                # The hold itself is real; the honest node's reports are genuine and accepted.
                assert artefact_paths(sandbox(tmp_path, "sim-000"), mine)[0].exists()
                await asyncio.to_thread(cp.drain)
                verdicts = await asyncio.to_thread(sql, database, "SELECT verdict FROM node_reports WHERE node_id = %s",
                                                   (honest,))
                assert verdicts == [{"verdict": "accepted"}]
                assert (await asyncio.to_thread(cp.get, theirs_r.id)).state == "active"

                if mode == "other-allocation":  # with another hold to point at, it names that one
                    two = (await on(forger)).allocations[-1].id
                    [pointed] = await reports_of(database, mine, "bound")
                    assert pointed.bound.allocation_id == mine
                    assert await asyncio.to_thread(sql, database, "SELECT 1 FROM node_reports WHERE allocation_id = %s",
                                                   (two,)) == []
            await asyncio.to_thread(cp.drain)
            await asyncio.to_thread(cp.check_invariants)

    run(scenario())


# -- the program ------------------------------------------------------------------------------


def test_the_nodesim_command_connects_fifty_nodes_and_stops_on_sigterm(database: str, tmp_path: Path) -> None:
    from controlplane.devtools import devstack
    from tests.nodes_support import ControlPlane
    from tests.test_gateway import GatewayThread

    names = [f"sim-{i:03d}" for i in range(50)]
    gateway = GatewayThread(database, every_beat())
    cp = ControlPlane(database)

    async def scenario() -> None:
        tokens = tmp_path / "tokens.json"
        root_token = cp.root.metadata[0][1].split(" ", 1)[1]
        await asyncio.to_thread(devstack.issue_join_tokens, cp.server.endpoint, root_token, cp.pool_id, names, tokens)
        ca = tmp_path / "ca.pem"
        ca.write_bytes(gateway.ca_pem)
        args = [
            "--sim", "50", "--gateway", gateway.endpoint, "--enrol-gateway", gateway.enrol_endpoint,
            "--sandbox", str(tmp_path / "sandbox"), "--tokens", str(tokens), "--ca", str(ca),
            "--heartbeat", "1", "--connect-rate", "200", "--log-format", "json",
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nodesim",
            *args,
            cwd=REPO,
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        lines: list[dict] = []

        async def read_log() -> None:
            assert proc.stderr is not None
            async for raw in proc.stderr:
                if raw.startswith(b"{"):
                    lines.append(json.loads(raw))

        reading = asyncio.create_task(read_log())
        try:
            connected = ("FROM nodes WHERE pool_id = %s AND session_id IS NOT NULL"
                         " AND connectivity = 'connected' AND daemon_version <> ''")
            await rows(database, "SELECT 1 " + connected + " HAVING count(*) = 50", cp.pool_id, timeout=60)
            nodes = await rows(database, "SELECT id, name " + connected, cp.pool_id)
            assert sorted(n["name"] for n in nodes) == names
            await heard_again(database, [n["id"] for n in nodes], times=1)
            # Progress lines: the counts, then the moment all are connected.
            await eventually(lambda: "all nodes connected" in [line["event"] for line in lines], timeout=30)
            assert "50 enrolled, 50 connected" in [line["event"] for line in lines]
            async def open_sessions() -> int:
                return len(gateway.gateway.hub.sessions())

            assert gateway.call(open_sessions()) == 50
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            await asyncio.wait_for(reading, 10)
            assert [line["event"] for line in lines][-1] == "fleet stopped"
            assert not [line for line in lines if line["level"] in ("warning", "error")]
            # The gateway saw every stream end with the process.
            await eventually(lambda: gateway.call(open_sessions()) == 0)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            reading.cancel()

    try:
        run(scenario())
    finally:
        cp.stop()
        gateway.stop()


def test_the_nodesim_script_runs_main() -> None:
    script = Path(sys.executable).parent / "nodesim"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=30, check=True)
    assert "--sim N" in done.stdout and "--forge" in done.stdout


def test_nodesim_imports_no_control_plane_or_gateway_code() -> None:
    for path in (REPO / "nodesim").glob("*.py"):
        imports = re.findall(r"^\s*(?:from|import)\s+([\w.]+)", path.read_text(), flags=re.M)
        allowed = (
            "nodesim",
            "bettercompute.node.v1",
            "k8s.deviceplugin.v1beta1",  # the kubelet's device plugin API, for its device plugin
            "grpc",
            "google.protobuf",
            "cryptography",
            "structlog",
            "__future__",
        )
        for module in imports:
            top = module.split(".")[0]
            assert module.startswith(allowed) or top in sys.stdlib_module_names, f"{path.name} imports {module}"


# -- against the real gateway -----------------------------------------------------------------


def test_the_fleet_binds_through_the_real_gateway_and_its_reports_pass_the_attestation_check(
    database: str, tmp_path: Path
) -> None:
    """nodesim, gateway/ and the control plane together: enrolment, Hello into atoms and labels,
    a reservation through the API moved to binding by the reservation worker, desired state from
    the database, and a bound report the worker accepts: the reservation becomes active."""
    from controlplane.pki import attest
    from controlplane.pki.config import PkiSettings
    from tests.nodes_support import ControlPlane
    from tests.test_gateway import GatewayThread, join_token, set_limits
    from tests.test_pki import arun, sql

    gateway = GatewayThread(database, every_beat())
    cp = ControlPlane(database)
    try:
        names = ["sim-000", "sim-001"]
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps([{"name": n, "joinToken": join_token(database, cp.pool_id, n)} for n in names]))
        ca = tmp_path / "ca.pem"
        ca.write_bytes(gateway.ca_pem)
        args = ["--sim", "2", "--gateway", gateway.endpoint, "--enrol-gateway", gateway.enrol_endpoint]
        args += ["--sandbox", str(tmp_path / "sandbox"), "--tokens", str(tokens), "--ca", str(ca), "--heartbeat", "0.2"]

        async def polled(query: str, *params: object, timeout: float = 30) -> list[dict]:
            """The rows of `query` once there are some (the gateway works on its own schedule)."""
            deadline = time.monotonic() + timeout
            while not (rows := await asyncio.to_thread(sql, database, query, params)):
                assert time.monotonic() < deadline, f"no rows: {query}"
                await asyncio.sleep(0.05)
            return rows

        async def scenario() -> None:
            async with Fleet(parse_args(args)) as fleet:
                await fleet.wait_connected(timeout=30)
                ids = [fleet.node(n).node_id for n in names]
                for node_id in ids:
                    [row] = await polled(
                        "SELECT labels FROM nodes WHERE id = %s AND labels ? 'bc.dev/cap.devices.limits'", node_id
                    )
                    assert row["labels"]["bc.dev/cap.devices.limits"] == {"value": "true", "source": "system"}
                atoms = await polled("SELECT device_uuid FROM atoms WHERE node_id = %s", ids[0])
                assert sorted(a["device_uuid"] for a in atoms) == sorted(gpu_uuid("sim-000", i) for i in range(8))

                created = await asyncio.to_thread(cp.create, count=2)
                alloc = created.allocations[-1]
                aid, node_id = alloc.id, alloc.node_id
                name = names[ids.index(node_id)]
                limits = {"cpu_millis": 2000, "memory_bytes": 4 * GIB, "cpus": "0-1", "mems": "0"}
                await asyncio.to_thread(set_limits, database, aid, limits)
                await asyncio.to_thread(cp.drain)  # the worker moves it to binding: the node hears of it
                [row] = await polled(  # as the gateway kept it for the reservation worker
                    "SELECT body, key_id, signature FROM node_reports WHERE allocation_id = %s AND kind = 'bound'",
                    aid,
                )
                assert artefact_paths(sandbox(tmp_path, name), aid)[2].is_dir()
                await polled("SELECT 1 FROM nodes WHERE id = %s AND applied_generation = desired_generation", node_id)

                async def check(pool: object) -> tuple[bool, str, pb.Report | None]:
                    async with pool.connection() as conn:  # type: ignore[attr-defined]
                        return await attest.verify_bound_report(
                            conn,
                            aid,
                            node_id,
                            row["body"],
                            row["key_id"],
                            row["signature"],
                            PkiSettings().offline_grace,
                        )

                ok, reason, report = await asyncio.to_thread(arun, database, check)
                assert (ok, reason) == (True, "")
                assert report is not None and report.bound.cgroup_parent == f"bcd-alloc-{aid}.slice"
                assert report.bound.env_file == f"/run/bcd/allocations/{aid}.env"

                # The worker judges the stored report the same way: active, with the node's binding.
                await asyncio.to_thread(cp.drain)
                active = await asyncio.to_thread(cp.get, created.id)
                assert active.state == "active" and active.binding.attested
                assert active.binding.cgroup_parent == f"bcd-alloc-{aid}.slice"
                assert sorted(active.binding.cdi_devices) == sorted(f"bcd.dev/gpu={d}" for d in alloc.device_ids)
                spec = artefact_paths(sandbox(tmp_path, name), aid)[0].read_text()
                assert cdi_problems(spec) == []
                await asyncio.to_thread(cp.check_invariants)

        run(scenario())
    finally:
        cp.stop()
        gateway.stop()
