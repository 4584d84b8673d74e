"""What a simulated fleet is told: the command line, parsed into frozen dataclasses.

`parse_args` is the one place flags become configuration, so tests drive the exact flags an operator
types (`Fleet(parse_args([...]))`) without starting a process.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

FORGE_MODES = ("unsigned", "foreign-key", "other-allocation", "other-node")
# The smallest MIG profile of MIG-capable models (seven of them fill the GPU).
SMALLEST_MIG_PROFILE = {
    "A100-SXM4-40GB": "1g.5gb", "A100-PCIE-40GB": "1g.5gb",
    "A100-SXM4-80GB": "1g.10gb", "A100-PCIE-80GB": "1g.10gb",
    "H100-SXM5-80GB": "1g.10gb", "H100-PCIE-80GB": "1g.10gb", "H100-NVL-94GB": "1g.12gb",
    "H200-SXM5-141GB": "1g.18gb",
}
METAL_LIES = ("unasked", "bad-checksum")
# Characters of an allocation id or a failure message a report (and its log line) carries; the
# longest id a node accepts is 128 (nodesim.artefacts.ALLOCATION_ID), the control plane's 32.
REPORT_MAX_CHARS = 256
# gRPC's default limit on a received message: a larger report would end the gateway's session.
MAX_REPORT_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class InventorySpec:
    """The hardware every simulated node reports (one shape for the whole fleet)."""

    gpus: int = 8
    gpu_model: str = "H100-SXM5-80GB"
    gpu_memory_mib: int = 81559
    numa_nodes: int = 2
    vcpus: int = 192
    memory_gib: int = 2048
    hugepages_1gi: int = 256
    hugepages_2mi: int = 0
    isolated_cpus: str = ""
    # Nodes per NVLink fabric cluster (consecutive nodes of the fleet share one); 0: no fabric.
    fabric_size: int = 1
    # The last `mig_gpus` GPUs of each node are in MIG mode with `mig_instances` instances of
    # `mig_profile` ('' : the smallest profile of the model, e.g. 1g.10gb on an H100 80GB, 1g.5gb
    # on an A100 40GB).
    mig_gpus: int = 0
    mig_profile: str = ""
    mig_instances: int = 7

    def instance_profile(self) -> str:
        return self.mig_profile or SMALLEST_MIG_PROFILE.get(self.gpu_model, "1g.10gb")


@dataclass(frozen=True)
class Faults:
    """Injected misbehaviour; `nodes` None means every node of the fleet."""

    nodes: frozenset[str] | None = None
    fail_binds: float = 0.0
    fail_allocations: frozenset[str] = frozenset()
    never_answer: bool = False
    unreachable_after: float | None = None
    restart_after: float | None = None
    # On demand instead of after a time: SIGUSR1 / Fleet.go_unreachable(), SIGUSR2 / Fleet.restart_now().
    unreachable_on_signal: bool = False
    restart_on_signal: bool = False
    no_capabilities: bool = False
    forge: str | None = None
    # Whole-machine leases (nodesim.metal): the share of reimages that fail, and a hostile node's lie.
    reimage_fail: float = 0.0
    metal_lie: str | None = None
    # A node that ignores RenewHints (renews only past half its certificate's life).
    ignore_renew_hints: bool = False

    def for_node(self, name: str) -> Faults:
        """The faults that apply to one node: these, or none when the node is not selected."""
        if self.nodes is None or name in self.nodes:
            return replace(self, nodes=None)
        return NO_FAULTS


NO_FAULTS = Faults()


@dataclass(frozen=True)
class FleetConfig:
    sim: int
    gateway: str
    sandbox: Path
    # (node name, join token) in the order of the tokens file.
    tokens: tuple[tuple[str, str], ...] = ()
    ca_pem: bytes | None = None
    # Where Enrol is served when it is not the session endpoint (server-auth TLS only).
    enrol_gateway: str | None = None
    # TLS server name to expect instead of the endpoint's host (grpc.ssl_target_name_override).
    server_name: str | None = None
    heartbeat: float = 5.0
    # Each heartbeat comes up to this fraction of the period after its place (nodesim.beats).
    heartbeat_jitter: float = 0.1
    # Nodes started per second (enrolment and first connection are staggered at this rate).
    connect_rate: float = 100.0
    # How often each node's device plugin looks for a (new) kubelet socket in its sandbox; 0: no plugin.
    kubelet_retry: float = 2.0
    # How long a simulated reimage (a whole-machine lease's deploy) and the wipe after it take.
    reimage_seconds: float = 2.0
    wipe_seconds: float = 1.0
    # What a report may carry: characters of an allocation id or failure message (the rest cut,
    # with a marker), and bytes of the whole message (gRPC's default limit on a received message;
    # a larger report is dropped, not sent: the gateway would end the session at every try).
    report_max_chars: int = REPORT_MAX_CHARS
    max_report_bytes: int = MAX_REPORT_BYTES
    inventory: InventorySpec = field(default_factory=InventorySpec)
    faults: Faults = NO_FAULTS
    log_format: str = "console"
    log_level: str = "info"

    def node_names(self) -> list[str]:
        """The first `sim` names of the tokens file, then sim-NNN names for nodes enrolled before."""
        names = [name for name, _ in self.tokens[: self.sim]]
        width = max(3, len(str(self.sim - 1)))
        taken = set(names)
        i = 0
        while len(names) < self.sim:
            candidate = f"sim-{i:0{width}d}"
            if candidate not in taken:
                names.append(candidate)
                taken.add(candidate)
            i += 1
        return names

    def join_token(self, name: str) -> str | None:
        return next((token for n, token in self.tokens if n == name), None)


def read_tokens(path: Path) -> tuple[tuple[str, str], ...]:
    """The tokens file: JSON `[{"name": "sim-000", "joinToken": "..."}, ...]`."""
    entries = json.loads(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of {{name, joinToken}}")
    out: list[tuple[str, str]] = []
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("name"), str)
            or not isinstance(entry.get("joinToken"), str)
        ):
            raise ValueError(f"{path}: each entry needs string name and joinToken: {entry!r}")
        out.append((entry["name"], entry["joinToken"]))
    return tuple(out)


def _rate(value: str) -> float:
    rate = float(value)
    if not 0.0 <= rate <= 1.0:
        raise argparse.ArgumentTypeError("a rate between 0 and 1")
    return rate


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError("a positive number")
    return number


def _jitter(value: str) -> float:
    number = float(value)
    if not 0.0 <= number < 0.5:
        raise argparse.ArgumentTypeError("a fraction of the period, at least 0 and below 0.5")
    return number


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        number = int(value)
        if number < minimum:
            raise argparse.ArgumentTypeError(f"at least {minimum}")
        return number

    return parse


def _names(value: str) -> frozenset[str]:
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nodesim",
        description="The FakeDaemon: N simulated GPU nodes, each a gRPC client of the gateway's NodeGateway.",
    )
    p.add_argument("--sim", type=int, required=True, metavar="N", help="number of simulated nodes")
    p.add_argument("--gateway", required=True, metavar="HOST:PORT", help="the gateway's session endpoint (mTLS)")
    p.add_argument(
        "--enrol-gateway",
        metavar="HOST:PORT",
        help="the gateway's enrolment endpoint (server-auth TLS); default: --gateway",
    )
    p.add_argument("--sandbox", type=Path, required=True, metavar="DIR", help="root of the nodes' file systems")
    p.add_argument("--tokens", type=Path, metavar="FILE", help='JSON [{"name": ..., "joinToken": ...}]')
    p.add_argument("--ca", type=Path, metavar="FILE", help="PEM of the CA that signed the gateway's certificate")
    p.add_argument("--server-name", help="TLS name to verify in the gateway certificate (default: the host)")
    p.add_argument("--heartbeat", type=_positive, default=5.0, metavar="SECONDS")
    p.add_argument("--heartbeat-jitter", type=_jitter, default=0.1, metavar="FRACTION",
                   help="each heartbeat comes up to this fraction of the period after its place (0 to 0.5)")
    p.add_argument("--connect-rate", type=_positive, default=100.0, metavar="PER_SECOND")
    p.add_argument("--kubelet-retry", type=float, default=2.0, metavar="SECONDS",
                   help="how often a node's device plugin looks for its kubelet's socket (0: no device plugin)")
    p.add_argument("--reimage-seconds", type=float, default=2.0, metavar="SECONDS",
                   help="how long a whole-machine lease's simulated reimage takes")
    p.add_argument("--wipe-seconds", type=float, default=1.0, metavar="SECONDS",
                   help="how long the simulated wipe after a whole-machine lease takes")
    p.add_argument("--report-max-chars", type=_at_least(128), default=REPORT_MAX_CHARS, metavar="N",
                   help="characters of an allocation id or a message a failure report carries; the rest is cut,"
                        " marked '…[<length> chars]' (at least 128, the longest allocation id a node accepts)")
    p.add_argument("--max-report-bytes", type=_at_least(1024), default=MAX_REPORT_BYTES, metavar="BYTES",
                   help="a report larger than this is dropped (logged), never sent (default: gRPC's 4 MiB)")
    p.add_argument("--log-format", choices=("console", "json"), default="console")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")

    inv = p.add_argument_group("inventory (every node)")
    d = InventorySpec()
    inv.add_argument("--gpus", type=int, default=d.gpus, help="GPUs per node")
    inv.add_argument("--gpu-model", default=d.gpu_model)
    inv.add_argument("--gpu-memory-mib", type=int, default=d.gpu_memory_mib)
    inv.add_argument("--numa-nodes", type=int, default=d.numa_nodes)
    inv.add_argument("--vcpus", type=int, default=d.vcpus)
    inv.add_argument("--memory-gib", type=int, default=d.memory_gib)
    inv.add_argument("--hugepages-1gi", type=int, default=d.hugepages_1gi)
    inv.add_argument("--hugepages-2mi", type=int, default=d.hugepages_2mi)
    inv.add_argument("--isolated-cpus", default=d.isolated_cpus, metavar="CPULIST")
    inv.add_argument("--fabric-size", type=int, default=d.fabric_size, help="nodes per NVLink cluster; 0: none")
    inv.add_argument("--mig-gpus", type=int, default=d.mig_gpus, help="GPUs per node in MIG mode (the last ones)")
    inv.add_argument("--mig-profile", default=d.mig_profile,
                     help="profile of every MIG instance (default: the model's smallest, e.g. 1g.10gb on H100 80GB, "
                          "1g.5gb on A100-SXM4-40GB)")
    inv.add_argument("--mig-instances", type=int, default=d.mig_instances, help="MIG instances per GPU (0 to 7)")

    f = p.add_argument_group("fault injection")
    f.add_argument("--fault-nodes", type=_names, metavar="NAME,NAME", help="apply faults to these nodes only")
    f.add_argument("--fail-binds", type=_rate, default=0.0, metavar="RATE", help="fail this share of binds")
    f.add_argument("--fail-allocations", type=_names, default=frozenset(), metavar="ID,ID")
    f.add_argument("--never-answer", action="store_true", help="accept desired state, never bind or report")
    f.add_argument("--unreachable-after", type=_positive, metavar="SECONDS")
    f.add_argument("--restart-after", type=_positive, metavar="SECONDS")
    f.add_argument("--unreachable-on-signal", action="store_true", help="go unreachable on SIGUSR1")
    f.add_argument("--restart-on-signal", action="store_true", help="restart (once) on SIGUSR2")
    f.add_argument("--no-capabilities", action="store_true", help="an older daemon: no capabilities")
    f.add_argument("--forge", choices=FORGE_MODES, help="send forged bind reports")
    f.add_argument("--reimage-fail-rate", type=_rate, default=0.0, metavar="RATE",
                   help="fail this share of whole-machine reimages")
    f.add_argument("--metal-lie", choices=METAL_LIES,
                   help="after a reimage, report another profile (unasked) or a wrong checksum (bad-checksum)")
    f.add_argument("--ignore-renew-hints", action="store_true", help="never renew on the gateway's hint")
    return p


def parse_args(argv: list[str] | None = None) -> FleetConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.sim < 1:
        parser.error("--sim must be at least 1")
    inventory = InventorySpec(
        gpus=a.gpus,
        gpu_model=a.gpu_model,
        gpu_memory_mib=a.gpu_memory_mib,
        numa_nodes=a.numa_nodes,
        vcpus=a.vcpus,
        memory_gib=a.memory_gib,
        hugepages_1gi=a.hugepages_1gi,
        hugepages_2mi=a.hugepages_2mi,
        isolated_cpus=a.isolated_cpus,
        fabric_size=a.fabric_size,
        mig_gpus=a.mig_gpus,
        mig_profile=a.mig_profile,
        mig_instances=a.mig_instances,
    )
    problem = check_inventory(inventory)
    if problem:
        parser.error(problem)
    faults = Faults(
        nodes=a.fault_nodes,
        fail_binds=a.fail_binds,
        fail_allocations=a.fail_allocations,
        never_answer=a.never_answer,
        unreachable_after=a.unreachable_after,
        restart_after=a.restart_after,
        unreachable_on_signal=a.unreachable_on_signal,
        restart_on_signal=a.restart_on_signal,
        no_capabilities=a.no_capabilities,
        forge=a.forge,
        reimage_fail=a.reimage_fail_rate,
        metal_lie=a.metal_lie,
        ignore_renew_hints=a.ignore_renew_hints,
    )
    try:
        tokens = read_tokens(a.tokens) if a.tokens else ()
    except (OSError, ValueError) as exc:
        parser.error(f"--tokens: {exc}")
    try:
        ca_pem = a.ca.read_bytes() if a.ca else None
    except OSError as exc:
        parser.error(f"--ca: {exc}")
    return FleetConfig(
        sim=a.sim,
        gateway=a.gateway,
        sandbox=a.sandbox,
        tokens=tokens,
        ca_pem=ca_pem,
        enrol_gateway=a.enrol_gateway,
        server_name=a.server_name,
        heartbeat=a.heartbeat,
        heartbeat_jitter=a.heartbeat_jitter,
        connect_rate=a.connect_rate,
        kubelet_retry=max(0.0, a.kubelet_retry),
        reimage_seconds=max(0.0, a.reimage_seconds),
        wipe_seconds=max(0.0, a.wipe_seconds),
        report_max_chars=a.report_max_chars,
        max_report_bytes=a.max_report_bytes,
        inventory=inventory,
        faults=faults,
        log_format=a.log_format,
        log_level=a.log_level,
    )


def check_inventory(spec: InventorySpec) -> str | None:
    if spec.gpus < 0 or spec.numa_nodes < 1 or spec.vcpus < spec.numa_nodes * 2 or spec.vcpus % (2 * spec.numa_nodes):
        return "--vcpus must be a positive multiple of 2 x --numa-nodes (two threads per core), --gpus >= 0"
    if not 0 <= spec.mig_gpus <= spec.gpus or not 0 <= spec.mig_instances <= 7:
        return "--mig-gpus must be between 0 and --gpus, --mig-instances between 0 and 7"
    if spec.fabric_size < 0 or spec.memory_gib < 1 or spec.hugepages_1gi < 0 or spec.hugepages_2mi < 0:
        return "--fabric-size, --hugepages-* must be >= 0 and --memory-gib >= 1"
    if spec.hugepages_1gi + spec.hugepages_2mi * 2 / 1024 > spec.memory_gib:
        return "huge pages exceed --memory-gib"
    return None
