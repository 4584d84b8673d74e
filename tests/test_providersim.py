"""providersim, the simulated provider, as a program of its own: its gRPC API over a real process,
its provider semantics (slots, stop, start, a reservation gone or shrunk) and its fault flags."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from bettercompute.provider.v1 import provider_pb2 as pb
from bettercompute.provider.v1 import provider_pb2_grpc as rpc

ACCOUNT = "acct-1"


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[rpc.ProviderStub, rpc.SimulatorStub]]:
    proc = subprocess.Popen([sys.executable, "-m", "providersim", "--listen", "127.0.0.1:0",
                             "--reservation", f"{ACCOUNT}/boot/n2-standard-8/eu-1/2"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("providersim listening on "), line
        channel = grpc.insecure_channel(line.split()[-1])
        yield rpc.ProviderStub(channel), rpc.SimulatorStub(channel)
        channel.close()
    finally:
        proc.terminate()
        proc.wait(10)


def create(provider: rpc.ProviderStub, name: str, reservation: str = "r1", flavor: str = "n2-standard-8") -> pb.Instance:
    return provider.CreateInstance(pb.CreateInstanceRequest(account=ACCOUNT, name=name, flavor=flavor,
                                                            region="eu-1", reservation=reservation))


def listed(provider: rpc.ProviderStub) -> dict[str, pb.Reservation]:
    return {r.name: r for r in provider.ListReservations(pb.ListReservationsRequest(account=ACCOUNT)).items}


def test_a_reservation_given_on_the_command_line_is_reported(sim) -> None:
    provider, _ = sim
    boot = listed(provider)["boot"]
    assert (boot.flavor, boot.region, boot.total, boot.state, boot.in_use) == ("n2-standard-8", "eu-1", 2, "ready", 0)


def test_instances_use_the_reservations_slots_until_it_is_full(sim) -> None:
    provider, simulator = sim
    simulator.PutReservation(pb.PutReservationRequest(account=ACCOUNT, name="r1", flavor="n2-standard-8",
                                                      region="eu-1", total=2))
    a, b = create(provider, "a"), create(provider, "b")
    assert (a.reservation, a.state, b.state) == ("r1", "running", "running")
    assert create(provider, "a") == a  # a retry with the same name returns the instance
    with pytest.raises(grpc.RpcError) as exc:
        create(provider, "c")
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as exc:
        create(provider, "d", flavor="other")
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert create(provider, "on-demand", reservation="").reservation == ""
    # A stopped instance frees its slot; starting it again needs one.
    assert provider.StopInstance(pb.InstanceRef(account=ACCOUNT, name="a")).state == "stopped"
    assert create(provider, "c").state == "running"
    with pytest.raises(grpc.RpcError) as exc:
        provider.StartInstance(pb.InstanceRef(account=ACCOUNT, name="a"))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert provider.DeleteInstance(pb.InstanceRef(account=ACCOUNT, name="c")).state == "deleted"
    assert provider.StartInstance(pb.InstanceRef(account=ACCOUNT, name="a")).state == "running"
    assert listed(provider)["r1"].in_use == 2
    # The account's instances, deleted ones left out.
    found = provider.ListInstances(pb.ListInstancesRequest(account=ACCOUNT)).items
    assert [(i.name, i.state) for i in found] == [("a", "running"), ("b", "running"), ("on-demand", "running")]
    assert provider.ListInstances(pb.ListInstancesRequest(account="nobody")).items == []


def test_a_total_drop_keeps_instances_and_a_gone_reservation_leaves_them_on_demand(sim) -> None:
    provider, simulator = sim
    simulator.PutReservation(pb.PutReservationRequest(account=ACCOUNT, name="r2", flavor="n2-standard-8",
                                                      region="eu-1", total=2))
    create(provider, "x", "r2")
    create(provider, "y", "r2")
    simulator.PutReservation(pb.PutReservationRequest(account=ACCOUNT, name="r2", total=1))
    r2 = listed(provider)["r2"]
    assert (r2.total, r2.in_use) == (1, 2)
    simulator.DeleteReservation(pb.DeleteReservationRequest(account=ACCOUNT, name="r2"))
    assert "r2" not in listed(provider)
    x = provider.GetInstance(pb.InstanceRef(account=ACCOUNT, name="x"))
    assert (x.state, x.reservation) == ("running", "")


def test_the_api_fails_at_a_rate_and_stalls(sim) -> None:
    provider, simulator = sim
    try:
        simulator.SetFaults(pb.Faults(failure_rate=1.0))
        with pytest.raises(grpc.RpcError) as exc:
            listed(provider)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        simulator.SetFaults(pb.Faults(failure_rate=0.5))
        outcomes = set()
        for _ in range(60):
            try:
                listed(provider)
                outcomes.add("ok")
            except grpc.RpcError as err:
                outcomes.add(err.code())
        assert outcomes == {"ok", grpc.StatusCode.UNAVAILABLE}
        simulator.SetFaults(pb.Faults(failure_rate=0.0, stall_ms=400))
        began = time.monotonic()
        listed(provider)
        assert time.monotonic() - began >= 0.4
        with pytest.raises(grpc.RpcError) as exc:
            provider.ListReservations(pb.ListReservationsRequest(account=ACCOUNT), timeout=0.1)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as exc:
            simulator.SetFaults(pb.Faults(failure_rate=2.0))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        simulator.SetFaults(pb.Faults())
