"""A node that lost its enrolment's answer retries with the same join token and the same CSRs and
gets the certificates it was issued; the token is spent once all the same, and nothing else (other
keys, an expired token, revoked certificates, a revoked node) is answered that way."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from bettercompute.node.v1 import node_pb2 as pb
from bettercompute.node.v1 import node_pb2_grpc
from controlplane.pki import admin, certs
from nodesim.config import parse_args
from nodesim.node import Shared, SimNode
from tests.support import rpc_error
from tests.test_gateway import GatewayThread, gateway, join_token  # noqa: F401 (gateway: a fixture)
from tests.test_pki import NodeKeys, arun, seed_pool, split, sql


def enrol(gateway: GatewayThread, token: str, keys: NodeKeys) -> pb.EnrolResponse:
    with grpc.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
        return node_pb2_grpc.NodeGatewayStub(ch).Enrol(pb.EnrolRequest(join_token=token, csr_pem=keys.csr()),
                                                       timeout=10)


def refused(gateway: GatewayThread, token: str, keys: NodeKeys) -> tuple[Any, ...]:
    with pytest.raises(grpc.RpcError) as failure:
        enrol(gateway, token, keys)
    return rpc_error(failure)[:2]


def serials(response: pb.EnrolResponse) -> list[str]:
    return [certs.serial_hex(c) for c in split(response.certificate_pem)]


def test_a_retry_with_the_same_token_and_csrs_answers_the_certificates_issued(gateway: GatewayThread) -> None:
    pool_id = seed_pool(gateway.conninfo)
    token, keys = join_token(gateway.conninfo, pool_id, "gpu-01"), NodeKeys()
    first = enrol(gateway, token, keys)
    again = enrol(gateway, token, keys)
    assert again.node_id == first.node_id and again.certificate_pem == first.certificate_pem
    assert again.not_after == first.not_after and again.ca_certificate_pem == first.ca_certificate_pem
    # Nothing issued or spent a second time: two certificates, both live, one spent token.
    rows = sql(gateway.conninfo, "SELECT serial FROM node_certs WHERE node_id = %s ORDER BY usage", (first.node_id,))
    assert [r["serial"] for r in rows] == serials(first)
    assert sql(gateway.conninfo, "SELECT count(*) AS n FROM revocations")[0]["n"] == 0
    assert sql(gateway.conninfo, "SELECT node_id FROM join_tokens")[0]["node_id"] == first.node_id

    # The same token with other keys (its thief, say) is refused as before: the CSRs prove the keys.
    assert refused(gateway, token, NodeKeys()) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    # One key of the pair is not enough either.
    half = NodeKeys(tls=keys.tls)
    assert refused(gateway, token, half) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_a_retry_is_refused_once_the_token_expired_or_the_certificates_were_revoked(gateway: GatewayThread) -> None:
    conninfo = gateway.conninfo
    pool_id = seed_pool(conninfo)
    token, keys = join_token(conninfo, pool_id, "gpu-01"), NodeKeys()
    enrol(gateway, token, keys)
    sql(conninfo, "UPDATE join_tokens SET expires_at = now() - interval '1 second'")
    assert refused(gateway, token, keys) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")

    token, keys = join_token(conninfo, pool_id, "gpu-02"), NodeKeys()
    issued = enrol(gateway, token, keys)
    tls_serial = serials(issued)[1]
    arun(conninfo, lambda pool: admin.revoke_certificates(pool, "", tls_serial, "key compromised"))
    assert refused(gateway, token, keys) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")

    # A node enrolled again with a new token: the first enrolment's certificates are superseded.
    token, keys = join_token(conninfo, pool_id, "gpu-03"), NodeKeys()
    enrol(gateway, token, keys)
    enrol(gateway, join_token(conninfo, pool_id, "gpu-03"), NodeKeys())
    assert refused(gateway, token, keys) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")

    # A node an operator revoked (its certificates with it) gets nothing back either.
    token, keys = join_token(conninfo, pool_id, "gpu-04"), NodeKeys()
    node_id = enrol(gateway, token, keys).node_id
    arun(conninfo, lambda pool: admin.revoke_certificates(pool, node_id, "", "machine taken"))
    assert refused(gateway, token, keys) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")


def test_concurrent_retries_of_one_enrolment_get_one_set_of_certificates(gateway: GatewayThread) -> None:
    pool_id = seed_pool(gateway.conninfo)
    token, keys = join_token(gateway.conninfo, pool_id, "gpu-01"), NodeKeys()

    async def race() -> list[Any]:
        async with grpc.aio.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
            stub = node_pb2_grpc.NodeGatewayStub(ch)
            request = pb.EnrolRequest(join_token=token, csr_pem=keys.csr())
            return await asyncio.gather(*(stub.Enrol(request, timeout=10) for _ in range(4)))

    answers = asyncio.run(race())
    assert len({a.certificate_pem for a in answers}) == 1
    assert sql(gateway.conninfo, "SELECT count(*) AS n FROM node_certs WHERE node_id IS NOT NULL")[0]["n"] == 2


class LosesFirstAnswer:
    """The network between a node and the gateway: the first Enrol reaches the gateway, which
    enrols the node, and its answer is lost on the way back."""

    def __init__(self, stub: node_pb2_grpc.NodeGatewayStub) -> None:
        self.stub, self.requests = stub, []

    async def Enrol(self, request: pb.EnrolRequest, timeout: float) -> pb.EnrolResponse:  # noqa: N802 - gRPC's name
        self.requests.append(request)
        answer = await self.stub.Enrol(request, timeout=timeout)
        if len(self.requests) == 1:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="connection reset")
        return answer


def test_the_node_daemon_retries_a_lost_enrolment_with_the_keys_it_sent(gateway: GatewayThread,
                                                                         tmp_path: Path) -> None:
    conninfo = gateway.conninfo
    pool_id = seed_pool(conninfo)
    token = join_token(conninfo, pool_id, "sim-000")
    (tmp_path / "ca.pem").write_bytes(gateway.ca_pem)
    (tmp_path / "tokens.json").write_text(f'[{{"name": "sim-000", "joinToken": "{token}"}}]')
    config = parse_args(["--sim", "1", "--gateway", gateway.endpoint, "--enrol-gateway", gateway.enrol_endpoint,
                         "--sandbox", str(tmp_path / "sandbox"), "--tokens", str(tmp_path / "tokens.json"),
                         "--ca", str(tmp_path / "ca.pem")])

    async def scenario() -> tuple[Any, LosesFirstAnswer]:
        async with grpc.aio.secure_channel(gateway.enrol_endpoint, grpc.ssl_channel_credentials(gateway.ca_pem)) as ch:
            network = LosesFirstAnswer(node_pb2_grpc.NodeGatewayStub(ch))
            node = SimNode("sim-000", 0, Shared(config=config, enrol=network, enrol_slots=asyncio.Semaphore(1)))
            with pytest.raises(grpc.aio.AioRpcError):
                await node._ensure_identity()
            return await node._ensure_identity(), network

    identity, network = asyncio.run(scenario())
    first, second = network.requests
    sent = [certs.parse_csr_bundle(r.csr_pem) for r in (first, second)]  # the keys, sent again
    assert [certs.spki(b.signing) for b in sent] == [certs.spki(sent[0].signing)] * 2
    assert [certs.spki(b.tls) for b in sent] == [certs.spki(sent[0].tls)] * 2
    [signing, tls] = sql(conninfo, "SELECT serial, node_id FROM node_certs WHERE node_id IS NOT NULL ORDER BY usage")
    assert identity.node_id == signing["node_id"] == tls["node_id"]
    assert sql(conninfo, "SELECT count(*) AS n FROM revocations")[0]["n"] == 0
