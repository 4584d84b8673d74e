"""Servicer for the NodeAdmin service (the node PKI): root only; each method calls one domain function."""

from __future__ import annotations

from typing import Any

import grpc
from cryptography import x509

from bettercompute.v1 import nodes_pb2 as pb
from bettercompute.v1 import nodes_pb2_grpc as rpc
from controlplane.api.interceptor import caller
from controlplane.pki import admin, certs
from controlplane.pki.config import PkiSettings
from controlplane.runtime import Runtime

Ctx = grpc.aio.ServicerContext


def _ms(when: Any) -> int:
    return int(when.timestamp() * 1000) if when is not None else 0


def _certificate(row: dict[str, Any]) -> pb.NodeCertificate:
    return pb.NodeCertificate(
        serial=row["serial"], node_id=row["node_id"], role=row["role"], usage=row["usage"], key_id=row["key_id"],
        not_before=_ms(row["not_before"]), not_after=_ms(row["not_after"]),
        revoked=row["revoked_at"] is not None, revoked_at=_ms(row["revoked_at"]),
        certificate_pem=certs.pem(x509.load_der_x509_certificate(bytes(row["certificate"]))).decode(),
    )


class NodeAdminServicer(rpc.NodeAdminServicer):
    def __init__(self, rt: Runtime, settings: PkiSettings | None = None) -> None:
        self.rt = rt
        self.settings = settings or PkiSettings()

    async def CreateJoinToken(self, request: pb.CreateJoinTokenRequest, context: Ctx) -> pb.JoinToken:
        caller().require_root()
        return pb.JoinToken(**await admin.create_join_token(
            self.rt.pool, request.pool_id, request.node_name, request.role, request.ttl_seconds))

    async def RevokeCertificates(
        self, request: pb.RevokeCertificatesRequest, context: Ctx
    ) -> pb.RevokeCertificatesResponse:
        caller().require_root()
        serials = await admin.revoke_certificates(self.rt.pool, request.node_id, request.serial, request.reason)
        return pb.RevokeCertificatesResponse(serials=serials)

    async def ReadmitNode(self, request: pb.ReadmitNodeRequest, context: Ctx) -> pb.ReadmitNodeResponse:
        caller().require_root()
        return pb.ReadmitNodeResponse(readmitted=await admin.readmit_node(self.rt.pool, request.node_id))

    async def ListNodeCertificates(
        self, request: pb.ListNodeCertificatesRequest, context: Ctx
    ) -> pb.ListNodeCertificatesResponse:
        caller().require_root()
        rows = await admin.list_node_certificates(self.rt.pool, request.node_id)
        return pb.ListNodeCertificatesResponse(items=[_certificate(r) for r in rows])

    async def ExportCaCertificate(self, request: pb.ExportCaCertificateRequest, context: Ctx) -> pb.CaCertificate:
        caller().require_root()
        ca = await admin.export_ca(self.rt.pool, self.settings)
        return pb.CaCertificate(certificate_pem=ca.pem.decode(), fingerprint=ca.fingerprint)
