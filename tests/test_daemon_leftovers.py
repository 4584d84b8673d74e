"""The node daemon against desired states only a hostile gateway sends (tests/nodesim_peer.py sends
them; the control plane never would): what its reports carry, what stays on disk when an assignment
turns invalid, cpusets naming CPUs the node does not have, and slot numbers too long to read.

The peer is a real gRPC server with gRPC's default limit on a received message (4 MiB), as the
gateway has.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.config import REPORT_MAX_CHARS
from tests.nodesim_peer import assignment, eventually
from tests.test_nodesim import applied, artefact_paths, bound_ids, gpus, run, sandbox, simulated

GRPC_MAX_MESSAGE = 4 * 1024 * 1024  # gRPC's default limit on a received message


def failures(node) -> list[tuple[str, str, str]]:  # type: ignore[no-untyped-def]
    return [(r.failed.allocation_id, r.failed.reason, r.failed.message) for r in node.events("failed")]


def test_a_huge_rejected_allocation_id_is_cut_in_its_failure_report_and_later_reports_still_go(
    tmp_path: Path,
) -> None:
    """The failure report repeated the id whole (twice: as the id and in the message), so a 3 MB id
    made a report the gateway could not take; it was sent again at every reconnect, first, and the
    node never reported anything again."""
    huge = "alloc_" + "x" * 3_000_000
    shown = huge[:REPORT_MAX_CHARS] + f"…[{len(huge)} chars]"

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            peer.set_desired(node.node_id, [assignment(huge, [g[0]])])
            await eventually(lambda: node.events("failed"))
            [(alloc, reason, message)] = failures(node)
            assert (alloc, reason) == (shown, "invalid-assignment")
            assert message.startswith("allocation id 'alloc_xxx") and message.endswith(" chars]")
            assert len(message) < REPORT_MAX_CHARS + 20
            await applied(node, peer.set_desired(node.node_id, [assignment("alloc_after", [g[1]])]))
            await eventually(lambda: bound_ids(node) == ["alloc_after"])
            assert artefact_paths(sandbox(tmp_path, "sim-000"), "alloc_after")[0].exists()

    run(scenario())


def test_a_report_too_big_to_send_is_dropped_and_does_not_hold_up_the_reports_after_it(tmp_path: Path) -> None:
    """A hold of tens of thousands of slots of one GPU: its bind report (the CDI device names) is
    over the gateway's 4 MiB, though the desired state was not. It broke every session, was sent
    again first in the next one, and nothing after it ever arrived."""

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            slots = [f"{g[0]}:{n}" for n in range(72_000)]
            many = assignment("alloc_many", slots, device_class="gpu.slot")
            names = sum(len(f"bcd.dev/gpu.slot={s}") + 3 for s in slots)
            assert pb.DesiredState(assignments=[many]).ByteSize() < GRPC_MAX_MESSAGE < names
            peer.set_desired(node.node_id, [many])
            await eventually(lambda: artefact_paths(sandbox(tmp_path, "sim-000"), "alloc_many")[0].exists())
            # Then something the node must still say: a failure, and a bind.
            peer.set_desired(node.node_id, [many, assignment("alloc_bad", ["GPU-none"])])
            await eventually(lambda: failures(node))
            assert [f[:2] for f in failures(node)] == [("alloc_bad", "device-missing")]
            await applied(node, peer.set_desired(node.node_id, [many, assignment("alloc_next", [g[1]])]))
            await eventually(lambda: "alloc_next" in bound_ids(node))
            assert "alloc_many" not in bound_ids(node)

    run(scenario())


def _limited(cpus: str = "0-3", mems: str = "") -> pb.Limits:
    return pb.Limits(cpu_millis=1000, cpus=cpus, mems=mems)


# (what the new version of a bound assignment does wrong, the reason the node reports)
INVALID_VERSIONS = {
    "not-a-cpulist": (lambda g: [assignment("alloc_turns", [g[0]], limits=_limited(cpus="all"))],
                      "invalid-assignment"),
    "unknown-gpu": (lambda g: [assignment("alloc_turns", ["GPU-none"], limits=_limited())], "device-missing"),
    "repeated-id": (lambda g: [assignment("alloc_turns", [g[0]], limits=_limited()),
                               assignment("alloc_turns", [g[1]], limits=_limited())], "invalid-assignment"),
    "held-device": (lambda g: [assignment("alloc_other", [g[2]]),
                               assignment("alloc_turns", [g[2]], limits=_limited())], "resources-exhausted"),
}


@pytest.mark.parametrize("case", list(INVALID_VERSIONS))
def test_an_assignment_that_turns_invalid_loses_its_hold_on_disk(tmp_path: Path, case: str) -> None:
    """The new version was reported failed, but the CDI spec, env file and slice of the earlier
    valid version stayed: the workload kept its devices the control plane no longer gave it."""
    version, reason = INVALID_VERSIONS[case]

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            valid = assignment("alloc_turns", [g[0]], limits=_limited())
            await applied(node, peer.set_desired(node.node_id, [valid]))
            assert bound_ids(node) == ["alloc_turns"]
            root = sandbox(tmp_path, "sim-000")
            assert all(p.exists() for p in artefact_paths(root, "alloc_turns"))
            await applied(node, peer.set_desired(node.node_id, version(g)))
            assert [f[:2] for f in failures(node)] == [("alloc_turns", reason)]
            assert not any(p.exists() for p in artefact_paths(root, "alloc_turns"))
            # The valid version again is a new bind of it.
            await applied(node, peer.set_desired(node.node_id, [valid]))
            assert bound_ids(node).count("alloc_turns") == 2
            assert all(p.exists() for p in artefact_paths(root, "alloc_turns"))

    run(scenario())


def test_a_cpuset_naming_cpus_or_numa_nodes_the_node_lacks_is_refused_and_nothing_written(tmp_path: Path) -> None:
    """cpus 0-4095 on an 8-vCPU node was written into the slice as it came."""
    refused = {
        "alloc_4096": _limited(cpus="0-4095"),
        "alloc_eight": _limited(cpus="0-3,8"),
        "alloc_backwards": _limited(cpus="5-3"),
        "alloc_digits": _limited(cpus="0-" + "9" * 5000),
        "alloc_mems": _limited(cpus="0-3", mems="0,2"),
    }

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"], "--vcpus", "8", "--numa-nodes", "2") as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            wanted = [assignment("alloc_ok", [g[0]], limits=_limited(cpus="0-7", mems="0-1"))]
            wanted += [assignment(alloc, [g[i + 1]], limits=limits) for i, (alloc, limits) in enumerate(refused.items())]
            await applied(node, peer.set_desired(node.node_id, wanted))
            assert bound_ids(node) == ["alloc_ok"]
            failed = {alloc: (reason, message) for alloc, reason, message in failures(node)}
            assert set(failed) == set(refused)
            assert {reason for reason, _ in failed.values()} == {"invalid-assignment"}
            assert "cpuset.cpus" in failed["alloc_4096"][1] and "0-7" in failed["alloc_4096"][1]
            assert "cpuset.mems" in failed["alloc_mems"][1]
            root = sandbox(tmp_path, "sim-000")
            assert (artefact_paths(root, "alloc_ok")[2] / "cpuset.cpus").read_text() == "0-7\n"
            for alloc in refused:
                assert not any(p.exists() for p in artefact_paths(root, alloc))

    run(scenario())


def test_a_slot_numbered_with_thousands_of_digits_is_missing_and_the_rest_still_converges(tmp_path: Path) -> None:
    """The node read a slot's or MIG instance's number with int(), which refuses more than 4300
    digits: the desired state's convergence raised, the session ended, and the next session got the
    same desired state: nothing of it (and no report) ever came."""

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"], "--mig-gpus", "1") as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            await applied(node, peer.set_desired(node.node_id, [
                assignment("alloc_slot", [f"{g[0]}:{'1' * 5000}"], device_class="gpu.slot"),
                assignment("alloc_mig", [f"{g[7]}:{'2' * 5000}"], device_class="gpu.mig"),
                assignment("alloc_ok", [g[1]]),
            ]))  # fmt: skip
            assert bound_ids(node) == ["alloc_ok"]
            assert {f[:2] for f in failures(node)} == {("alloc_slot", "device-missing"),
                                                      ("alloc_mig", "device-missing")}

    run(scenario())
