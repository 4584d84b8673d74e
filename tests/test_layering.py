"""The house's layering rules (DESIGN §3), checked on the source so they stay true:

- every table of the nodes package (nodes, atoms, host resources, node reports, report
  sequences) is written only by controlplane/nodes/ (migrations aside), and the SQL functions
  that write node rows are called only from there;
- the gateway is transport: it imports the nodes package, the PKI, the shared vocabulary
  (controlplane.common) and process-level modules, nothing else of the control plane;
- nodesim is another program: it imports nothing of controlplane or gateway; providersim too;
- the vps package's tables (provider accounts and reservations, grants, projects, instances,
  their segments, the usage ledger) are written only by controlplane/vps/queries.py, and the
  vps package's domain modules never import grpc (the provider adapter, sim_adapter, is transport);
- only the servers' assembly (controlplane/app.py) and the servicers themselves import
  controlplane.api.
"""

from __future__ import annotations

import ast
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("controlplane", "gateway", "nodesim", "providersim")

NODE_TABLES = r"(nodes|atoms|gpu_holders|host_resources|node_reports|report_sequences)"
NODE_TABLE_WRITE = re.compile(rf"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+{NODE_TABLES}\b")
NODE_ONLY_TABLES = re.compile(r"\b(node_reports|host_resources|report_sequences)\b")
NODE_WRITING_FUNCTIONS = re.compile(r"\b(bump_desired|node_seen|sweep_unreachable)\s*\(")

# The gateway is transport: it calls the node owner and PKI, and shares the process plumbing
# (database, LISTEN helper, settings, logs, metrics, errors, ids); never reservations or the API.
GATEWAY_MAY_IMPORT = ("controlplane.nodes", "controlplane.pki", "controlplane.common", "controlplane.db",
                      "controlplane.listen", "controlplane.metrics", "controlplane.config", "controlplane.logs",
                      "controlplane.errors", "controlplane.ids")


def sources(*packages: str) -> list[pathlib.Path]:
    return sorted(p for package in packages for p in (REPO / package).rglob("*.py"))


def relative(path: pathlib.Path) -> str:
    return path.relative_to(REPO).as_posix()


def imported(path: pathlib.Path) -> list[str]:
    """Every module the file imports (at any depth, `from a import b` as `a.b`)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_sources_are_there() -> None:
    """The scans below look at real files (a moved tree would make them pass vacuously)."""
    assert len(sources("controlplane/nodes")) >= 8
    assert len(sources("gateway")) >= 8
    assert len(sources("nodesim")) >= 5


def test_only_the_nodes_package_writes_node_tables() -> None:
    found = []
    for path in sources(*PRODUCT):
        if within(relative(path).removesuffix(".py").replace("/", "."), "controlplane.nodes"):
            continue
        text = path.read_text()
        for pattern in (NODE_TABLE_WRITE, NODE_ONLY_TABLES, NODE_WRITING_FUNCTIONS):
            found += [f"{relative(path)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert found == []


def test_the_scan_finds_a_write_to_a_node_table() -> None:
    """The patterns themselves, against statements the nodes package does run."""
    text = (REPO / "controlplane/nodes/queries.py").read_text()
    assert NODE_TABLE_WRITE.search(text) and NODE_ONLY_TABLES.search(text) and NODE_WRITING_FUNCTIONS.search(text)


def test_the_gateway_imports_only_the_nodes_package_pki_and_shared_names() -> None:
    wrong = [f"{relative(path)}: {name}" for path in sources("gateway") for name in imported(path)
             if within(name, "controlplane") and not any(within(name, ok) for ok in GATEWAY_MAY_IMPORT)]
    assert wrong == []


def test_nodesim_imports_nothing_of_controlplane_or_gateway() -> None:
    wrong = [f"{relative(path)}: {name}" for path in sources("nodesim") for name in imported(path)
             if within(name, "controlplane") or within(name, "gateway")]
    assert wrong == []


def test_only_the_server_assembly_imports_the_api() -> None:
    allowed = {"controlplane/app.py"}
    wrong = [f"{relative(path)}: {name}" for path in sources(*PRODUCT) for name in imported(path)
             if within(name, "controlplane.api") and relative(path) not in allowed
             and not relative(path).startswith("controlplane/api/")]
    assert wrong == []


VPS_TABLES = (r"(provider_accounts|provider_reservations|reservation_grants|projects|instances|instance_segments"
              r"|usage_records|metering_progress)")
VPS_TABLE_WRITE = re.compile(rf"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+{VPS_TABLES}\b")


def test_only_the_vps_queries_write_vps_tables() -> None:
    found = []
    for path in sources(*PRODUCT):
        if relative(path) == "controlplane/vps/queries.py":
            continue
        found += [f"{relative(path)}: {m.group(0)}" for m in VPS_TABLE_WRITE.finditer(path.read_text())]
    assert found == []
    assert VPS_TABLE_WRITE.search((REPO / "controlplane/vps/queries.py").read_text())


def test_providersim_imports_nothing_of_the_control_plane() -> None:
    assert len(sources("providersim")) >= 3
    wrong = [f"{relative(path)}: {name}" for path in sources("providersim") for name in imported(path)
             if within(name, "controlplane") or within(name, "gateway") or within(name, "nodesim")]
    assert wrong == []


def test_vps_domain_code_never_imports_grpc() -> None:
    wrong = [f"{relative(path)}: {name}" for path in sources("controlplane/vps") for name in imported(path)
             if within(name, "grpc") and relative(path) != "controlplane/vps/sim_adapter.py"]
    assert wrong == []
