"""Node profiles (the Admin API, root only) and what a create of a node lease is refused for.

Spec "Bindings": node needs `node { profileId, profileVersion? }`, a pool whose policy sets
tenantRoot, and cannot be spot. Profiles are operator-managed: a version names an image and its
checksum and never changes once registered.
"""

from __future__ import annotations

import hashlib
import uuid

import grpc
import pytest

from bettercompute.v1 import admin_pb2 as apb
from bettercompute.v1 import reservations_pb2 as pb
from controlplane import errors
from controlplane.metal import deploy
from controlplane.reservations.validate import validate_create
from tests.support import Client, World, gpus, rpc_error


def checksum(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def register(root: Client, *versions: int, profile_id: str | None = None) -> str:
    """A profile with these versions (image and checksum derived from the version)."""
    profile_id = profile_id or f"ubuntu-{uuid.uuid4().hex[:8]}"
    root.admin("CreateNodeProfile", apb.CreateNodeProfileRequest(id=profile_id, description="Ubuntu with drivers"))
    for v in versions:
        image = f"registry.example.com/metal/{profile_id}:{v}"
        root.admin("AddNodeProfileVersion", apb.AddNodeProfileVersionRequest(
            profile_id=profile_id, version=v, image=image, checksum=checksum(image)))
    return profile_id


def refused(call, *args) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as exc:
        call(*args)
    return rpc_error(exc)


def test_profiles_are_registered_listed_and_read_and_a_version_never_changes(world: World) -> None:
    root = world.root
    profile_id = register(root, 1, 2)
    got = root.admin("GetNodeProfile", apb.GetNodeProfileRequest(profile_id=profile_id))
    assert got.description == "Ubuntu with drivers"
    assert [v.version for v in got.versions] == [1, 2]
    image = f"registry.example.com/metal/{profile_id}:2"
    assert (got.versions[1].image, got.versions[1].checksum) == (image, checksum(image))
    assert profile_id in [p.id for p in root.admin("ListNodeProfiles", apb.ListNodeProfilesRequest()).items]

    # The same again changes nothing (an operator's retry); another image or checksum is CONFLICT.
    again = register(root, 2, profile_id=profile_id)
    assert again == profile_id
    assert len(root.admin("GetNodeProfile", apb.GetNodeProfileRequest(profile_id=profile_id)).versions) == 2
    code, reason, details = refused(root.admin, "AddNodeProfileVersion", apb.AddNodeProfileVersionRequest(
        profile_id=profile_id, version=2, image=image, checksum=checksum("something else")))
    assert (code, reason) == (grpc.StatusCode.ABORTED, "CONFLICT")
    assert details["profileId"] == profile_id and details["version"] == "2"


@pytest.mark.parametrize(("request_", "field"), [
    (apb.AddNodeProfileVersionRequest(version=1, image="r.example/x:1", checksum=checksum("x")), "profileId"),
    (apb.AddNodeProfileVersionRequest(profile_id="p", version=0, image="r.example/x:1", checksum=checksum("x")),
     "version"),
    (apb.AddNodeProfileVersionRequest(profile_id="p", version=1, image="bad image", checksum=checksum("x")), "image"),
    (apb.AddNodeProfileVersionRequest(profile_id="p", version=1, image="r.example/x:1", checksum="md5:abc"),
     "checksum"),
    (apb.AddNodeProfileVersionRequest(profile_id="p", version=1, image="r.example/x:1",
                                      checksum="sha256:" + "A" * 64), "checksum"),
])
def test_a_malformed_version_is_invalid_input_naming_the_field(world: World, request_, field: str) -> None:
    code, reason, details = refused(world.root.admin, "AddNodeProfileVersion", request_)
    assert (code, reason, details["field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", field)


def test_profiles_are_root_only_and_an_unknown_one_is_not_found(world: World) -> None:
    code, reason, details = refused(world.root.admin, "GetNodeProfile", apb.GetNodeProfileRequest(profile_id="nope"))
    assert (reason, details["profileId"]) == ("NOT_FOUND", "nope")
    code, reason, _ = refused(world.root.admin, "AddNodeProfileVersion", apb.AddNodeProfileVersionRequest(
        profile_id="nope", version=1, image="r.example/x:1", checksum=checksum("x")))
    assert reason == "NOT_FOUND"
    code, reason, details = refused(world.root.admin, "CreateNodeProfile", apb.CreateNodeProfileRequest(id="Bad Id"))
    assert (reason, details["field"]) == ("INVALID_INPUT", "id")
    code, reason, _ = refused(world.user.admin, "ListNodeProfiles", apb.ListNodeProfilesRequest())
    assert reason == "ACCESS_DENIED"


# -- creates ------------------------------------------------------------------------------------


def tenant_root_pool(world: World) -> str:
    return world.root.admin("CreatePool", apb.CreatePoolRequest(
        owner_tenant_id=world.tenant, name="metal", region="eu-1", policy=apb.PoolPolicy(tenant_root=True))).id


def lease(world: World, profile_id: str, version: int | None = None, **kw) -> pb.Reservation:
    node = pb.NodeLease(profile_id=profile_id)
    if version is not None:
        node.profile_version = version
    return world.create(count=kw.pop("count", 8), binding="node", node=node, **kw)


def test_a_node_lease_needs_a_tenant_root_pool_and_a_registered_profile(world: World) -> None:
    profile_id = register(world.root, 1, 3)
    code, reason, details = refused(lease, world, profile_id)  # the world's pool has no tenantRoot
    assert (code, reason, details["field"], details["poolId"]) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_INPUT", "binding", world.pool_id)

    pool_id = tenant_root_pool(world)
    code, reason, details = refused(lambda: lease(world, "no-such-profile", pool_id=pool_id))
    assert (reason, details["field"], details["profileId"]) == ("NOT_FOUND", "node.profileId", "no-such-profile")
    code, reason, details = refused(lambda: lease(world, profile_id, 2, pool_id=pool_id))
    assert (reason, details["field"], details["profileVersion"]) == ("NOT_FOUND", "node.profileVersion", "2")

    # Without a version: pinned to the newest when created. The pool's one node was registered by
    # an operator, never enrolled: not platform-trusted, so the lease waits pending.
    world.root.admin("RegisterNode", apb.RegisterNodeRequest(pool_id=pool_id, name="registered", gpus=gpus("r")))
    r = lease(world, profile_id, pool_id=pool_id)
    assert r.request.binding == "node" and r.request.node.profile_id == profile_id
    assert r.request.node.profile_version == 3 and r.state == "pending"
    assert "platform-trusted" in r.conditions[0].message and "1 not connected" in r.conditions[0].message
    # The draft was not written for the refusals: none of them spent anything.
    assert world.sql("SELECT count(*) FROM reservations WHERE tenant_id = %s", (world.tenant,))[0][0] == 1


def test_node_is_only_for_binding_node_and_binding_node_needs_it(world: World) -> None:
    code, reason, details = refused(lambda: world.create(count=1, node=pb.NodeLease(profile_id="x")))
    assert (reason, details["field"]) == ("INVALID_INPUT", "node")
    code, reason, details = refused(lambda: world.create(count=8, binding="node"))
    assert (reason, details["field"]) == ("INVALID_INPUT", "node")
    code, reason, details = refused(lambda: lease(world, "x", topology="numa"))
    assert (reason, details["field"]) == ("INVALID_INPUT", "devices[0].topology")


def _raw(**extra) -> dict:
    return {"tenant_id": "t", "pool_id": "pool_" + "0" * 26, "idempotency_key": "k", "binding": "node",
            "devices": [{"class": "gpu", "count": 8}], "duration": "1h",
            "node": {"profile_id": "ubuntu", "profile_version": None}, **extra}


@pytest.mark.parametrize(("extra", "field"), [
    ({"spot": True}, "spot"),
    ({"resources": {"vcpu": 4}}, "resources"),
    ({"node": {"profile_id": "Ubuntu!", "profile_version": None}}, "node.profileId"),
    ({"node": {"profile_id": "ubuntu", "profile_version": 0}}, "node.profileVersion"),
])
def test_a_node_lease_is_never_spot_and_books_no_host_resources(extra: dict, field: str) -> None:
    """Checked on the request as the API hands it to validation (spot and resources are fields
    other work adds; the rule holds the moment they arrive)."""
    with pytest.raises(errors.InvalidInput) as exc:
        validate_create(_raw(**extra))
    assert exc.value.details["field"] == field
    assert validate_create(_raw()).request["node"] == {"profileId": "ubuntu", "profileVersion": None}


# -- the verdict on what a node reports ---------------------------------------------------------

DEPLOY = {"allocation_id": "alloc_06h2mzqnv4vbc8r8tvsmza88vg", "profile_id": "ubuntu", "version": 2,
          "checksum": checksum("image")}


def _said(**kw) -> dict:
    return {"allocation_id": DEPLOY["allocation_id"], "profile_id": "ubuntu", "version": 2,
            "checksum": checksum("image"), "state": "deployed", "message": "", **kw}


@pytest.mark.parametrize(("deployed", "verdict", "why"), [
    (None, "waiting", ""),
    (_said(state="deploying", checksum=""), "waiting", ""),
    (_said(), "bound", ""),
    (_said(checksum=checksum("tampered")), "failed", deploy.CHECKSUM_MISMATCH),
    (_said(checksum=""), "failed", deploy.CHECKSUM_MISMATCH),
    (_said(state="failed", message="disk error"), "failed", deploy.FAILED),
    (_said(profile_id="rogue"), "rejected", deploy.NOT_ASKED),
    (_said(version=1), "rejected", deploy.NOT_ASKED),
    (_said(allocation_id=""), "rejected", deploy.NOT_ASKED),
    (_said(allocation_id="alloc_06h2mzqnv4vbc8r8tvsmza88vx"), "waiting", ""),  # a previous lease's disk
    (_said(allocation_id="alloc_06h2mzqnv4vbc8r8tvsmza88vx", state="wiped"), "waiting", ""),
])
def test_only_the_asked_version_with_the_asked_checksum_binds(deployed, verdict: str, why: str) -> None:
    got, reason = deploy.judge(DEPLOY, deployed)
    assert got == verdict and reason.startswith(why)


def test_what_a_node_says_is_on_its_disk_is_stored_bounded() -> None:
    """A node's DeployedProfile is its own word: malformed ids, checksums and states read as empty
    (so they never match a deploy), long or NUL-bearing text is cut (jsonb refuses NUL)."""
    from bettercompute.node.v1 import node_pb2
    from controlplane.nodes.inventory import deployed_json

    hostile = node_pb2.DeployedProfile(
        allocation_id="alloc_../../etc", profile_id="Ubuntu!", version=2, image="x\x00" * 1000,
        checksum="sha256:" + "G" * 64, state="bound", message="m\x00" * 1000)
    stored = deployed_json(hostile)
    assert (stored["allocation_id"], stored["profile_id"], stored["checksum"], stored["state"]) == ("", "", "", "")
    assert "\x00" not in stored["image"] + stored["message"]
    assert len(stored["image"]) <= 512 and len(stored["message"]) <= 256
    good = node_pb2.DeployedProfile(allocation_id=DEPLOY["allocation_id"], profile_id="ubuntu", version=2,
                                    image="r.example/u:2", checksum=DEPLOY["checksum"], state="deployed")
    assert deploy.judge(DEPLOY, deployed_json(good)) == ("bound", "")
    assert deploy.judge(DEPLOY, stored)[0] == "waiting"  # the state is unreadable: nothing to judge
