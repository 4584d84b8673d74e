"""A hostile control plane (or gateway) against the node daemon's writes: desired states whose
strings reach the CDI spec, the env file and the cgroup slice under the node's root.

The peer (tests/nodesim_peer.py) sends what the real gateway never would: the control plane mints
allocation ids, and the limits it sends come from bounded host resources and a cpuset it formats
itself (controlplane/nodes/desired.py), so only a hostile gateway can send these.
"""

from __future__ import annotations

from pathlib import Path

from bettercompute.node.v1 import node_pb2 as pb
from nodesim.artefacts import Sandbox
from tests.nodesim_peer import assignment, eventually
from tests.test_nodesim import GIB, applied, artefact_paths, bound_ids, gpus, run, sandbox, simulated


def failed_reasons(node) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {r.failed.allocation_id: r.failed.reason for r in node.events("failed")}


def test_a_cpuset_that_is_not_a_cpulist_is_refused_and_never_written_into_the_slice(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            peer.set_desired(node.node_id, [
                assignment("alloc_ok", [g[0]], limits=pb.Limits(cpu_millis=1000, cpus="0-3,8", mems="0")),
                assignment("alloc_line", [g[1]], limits=pb.Limits(cpu_millis=1000, cpus="0-3\nmax")),
                assignment("alloc_nul", [g[2]], limits=pb.Limits(cpu_millis=1000, mems="0\x001")),
                assignment("alloc_word", [g[3]], limits=pb.Limits(cpu_millis=1000, cpus="all")),
            ])  # fmt: skip
            await eventually(lambda: len(node.events("failed")) == 3)
            assert bound_ids(node) == ["alloc_ok"]
            assert failed_reasons(node) == dict.fromkeys(("alloc_line", "alloc_nul", "alloc_word"),
                                                         "invalid-assignment")
            root = sandbox(tmp_path, "sim-000")
            assert (artefact_paths(root, "alloc_ok")[2] / "cpuset.cpus").read_text() == "0-3,8\n"
            for alloc in ("alloc_line", "alloc_nul", "alloc_word"):
                assert not any(p.exists() for p in artefact_paths(root, alloc))

    run(scenario())


def test_a_negative_limit_is_refused_and_never_buys_room_for_another_hold(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            memory = node.hellos[-1].inventory.memory_bytes
            peer.set_desired(node.node_id, [
                # Its negative memory would have been written as "max" (unlimited) and subtracted
                # from what the node's other holds ask of the host.
                assignment("alloc_credit", [g[0]], limits=pb.Limits(memory_bytes=-memory)),
                assignment("alloc_big", [g[1]], limits=pb.Limits(memory_bytes=memory + GIB)),
                assignment("alloc_cpu", [g[2]], limits=pb.Limits(cpu_millis=-1000)),
                assignment("alloc_pages", [g[3]], limits=pb.Limits(hugepages_1gi=-1)),
            ])  # fmt: skip
            await eventually(lambda: len(node.events("failed")) == 4)
            assert failed_reasons(node) == {"alloc_credit": "invalid-assignment", "alloc_big": "resources-exhausted",
                                            "alloc_cpu": "invalid-assignment", "alloc_pages": "invalid-assignment"}
            assert bound_ids(node) == []

    run(scenario())


def test_a_hold_whose_id_looks_like_a_temporary_file_survives_a_restart(tmp_path: Path) -> None:
    """An id with the temporary files' mark in it ("<name>.tmp-<pid>") is a safe file name: its
    spec and env file were taken for leftovers of an interrupted write when the daemon restarted,
    and removed, so the node dropped a hold on its own until the next desired state."""

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, fleet):
            node = peer.by_name("sim-000")
            alloc = "alloc.tmp-1"
            await applied(node, peer.set_desired(node.node_id, [assignment(alloc, [gpus(node)[0]])]))
            assert bound_ids(node) == [alloc]
            await fleet.stop()
        root = sandbox(tmp_path, "sim-000")
        spec, env, _ = artefact_paths(root, alloc)
        before = (spec.read_bytes(), env.read_bytes())
        # What a restarted daemon does first, before it hears of any desired state.
        assert [h.allocation_id for h in Sandbox(root).recover()] == [alloc]
        assert (spec.read_bytes(), env.read_bytes()) == before

    run(scenario())


def test_an_allocation_id_twice_in_one_desired_state_is_refused_not_written_twice(tmp_path: Path) -> None:
    """Both assignments would write the same files: each desired state wrote one, then the other,
    and reported two bindings of one allocation on other devices, again at every push."""

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"]) as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            twice = [assignment("alloc_twice", [g[0]]), assignment("alloc_twice", [g[1]]),
                     assignment("alloc_ok", [g[2]])]
            await applied(node, peer.set_desired(node.node_id, twice))
            await applied(node, peer.set_desired(node.node_id, twice))
            assert bound_ids(node) == ["alloc_ok"]
            assert [(r.failed.allocation_id, r.failed.reason) for r in node.events("failed")] == [
                ("alloc_twice", "invalid-assignment")]
            assert not any(p.exists() for p in artefact_paths(sandbox(tmp_path, "sim-000"), "alloc_twice"))

    run(scenario())


def test_a_deploy_with_a_line_break_in_its_image_fails_and_writes_no_disk(tmp_path: Path) -> None:
    """The control plane takes only an operator's single-line image and a sha256 checksum; a deploy
    from anywhere else with a line break in its image wrote a checksum line of its choosing onto
    the machine's disk."""
    good = "sha256:" + "0" * 64

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"], "--reimage-seconds", "0") as (peer, fleet):
            node = peer.by_name("sim-000")
            metal = fleet.node("sim-000").metal
            lease = assignment("alloc_lease", gpus(node), binding=pb.BINDING_NODE)
            lease.deploy.CopyFrom(pb.Deploy(profile_id="p", version=1, image=f"img\nchecksum {good}",
                                            checksum="sha256:" + "1" * 64))
            await applied(node, peer.set_desired(node.node_id, [lease]))
            await eventually(lambda: (metal.record or {}).get("state") in ("deployed", "failed"))
            assert metal.record["state"] == "failed" and "image" in metal.record["message"]
            assert not metal.image_path.exists()

    run(scenario())


def test_a_mig_instance_spelled_with_a_leading_zero_is_no_second_instance(tmp_path: Path) -> None:
    """"<uuid>:01" was read as instance 1 but compared as another id than "<uuid>:1": two holds
    (or one, twice) got the same MIG instance."""

    async def scenario() -> None:
        async with simulated(tmp_path, ["sim-000"], "--mig-gpus", "2") as (peer, _):
            node = peer.by_name("sim-000")
            g = gpus(node)
            await applied(node, peer.set_desired(node.node_id, [
                assignment("alloc_one", [f"{g[6]}:1"], device_class="gpu.mig"),
                assignment("alloc_zero_one", [f"{g[6]}:01"], device_class="gpu.mig"),
                assignment("alloc_both", [f"{g[7]}:2", f"{g[7]}:02"], device_class="gpu.mig"),
            ]))  # fmt: skip
            assert bound_ids(node) == ["alloc_one"]
            assert failed_reasons(node) == {"alloc_zero_one": "device-missing", "alloc_both": "device-missing"}

    run(scenario())
