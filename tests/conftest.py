"""Fixtures: one embedded PostgreSQL per session with a migrated template database; per module a
database cloned from the template and a real control plane on a loopback port; per test that
moves the clock, a database and control plane of its own (clock_stack, clock_world, and `world`
in a module whose stack has clock control).

Every database cloned during a module is dropped after it; channels and connections a test opened
are closed after it. Hypothesis runs with the suite's profile (below). Benchmarks (marker `bench`)
run only when asked for with `-m bench`; `--slow` runs the stateful tests with more examples.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from hypothesis import HealthCheck, settings

from controlplane import bootstrap, db
from controlplane.config import Settings
from controlplane.logs import configure_logging
from tests.support import OPENED, Client, ServerThread, World, make_world

TEMPLATE = "bc_template"

# Hypothesis: no per-example deadline (the machine is shared and loaded, so a slow example is not a
# failure); in CI (CI=true) a fixed derandomized run, so a red build reproduces.
settings.register_profile(
    "suite",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI", "").lower() == "true",
    print_blob=True,
)
settings.load_profile("suite")

STATEFUL_EXAMPLES = 10
STATEFUL_EXAMPLES_SLOW = 100


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help=f"run the stateful property tests with {STATEFUL_EXAMPLES_SLOW} examples, "
                          f"not {STATEFUL_EXAMPLES}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Benchmarks are not part of the suite: they run only under a marker expression that names
    them (`-m bench`)."""
    if "bench" in (config.option.markexpr or ""):
        return
    kept = [item for item in items if item.get_closest_marker("bench") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept


def stateful_examples(config: pytest.Config) -> int:
    """How many examples a stateful (RuleBasedStateMachine) test runs: more under --slow."""
    return STATEFUL_EXAMPLES_SLOW if config.getoption("slow") else STATEFUL_EXAMPLES


@pytest.fixture(scope="session")
def pg_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    # The data directory is our own temp dir, not pytest's numbered ones: concurrent pytest runs
    # prune each other's old numbered dirs, which would pull it from under a running server.
    data_dir = tempfile.mkdtemp(prefix="bc-test-pg-")
    atexit.register(shutil.rmtree, data_dir, True)  # registered first, so it runs after the stop
    # INFO lines (one per RPC) go to a file, so tests can capture them and CI output stays short.
    log_path = tmp_path_factory.mktemp("logs") / "controlplane.log"
    configure_logging("json", stream=open(log_path, "a", buffering=1))  # noqa: SIM115 - lives for the session
    uri = db.start_embedded(data_dir, fast=True)
    with psycopg.connect(uri, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE}")
        conn.execute(f"CREATE DATABASE {TEMPLATE}")
    db.migrate(db.with_database(uri, TEMPLATE))
    _CLONES.admin_uri = uri
    return uri


class _Clones:
    """The databases cloned from the template, in order, so each module drops its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.names: list[str] = []
        self.admin_uri = ""

    def add(self, name: str) -> None:
        with self.lock:
            self.names.append(name)

    def mark(self) -> int:
        with self.lock:
            return len(self.names)

    def drop_since(self, mark: int) -> None:
        with self.lock:
            names, self.names[mark:] = self.names[mark:], []
        for name in reversed(names):
            drop_database(self.admin_uri, name)


_CLONES = _Clones()


def clone_database(pg_uri: str) -> str:
    """A fresh database cloned from the migrated template; dropped after the module that made it."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_uri, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    _CLONES.add(name)
    return db.with_database(pg_uri, name)


def drop_database(pg_uri: str, name: str) -> None:
    """Drop a cloned database; FORCE ends the sessions a stopped server or process left behind."""
    with psycopg.connect(pg_uri, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="module", autouse=True)
def _drop_module_databases() -> Iterator[None]:
    """Set up before (so torn down after) every other fixture of the module: the servers and
    processes on the module's databases have stopped by then."""
    mark = _CLONES.mark()
    yield
    if _CLONES.admin_uri:
        _CLONES.drop_since(mark)


@pytest.fixture(autouse=True)
def _close_what_the_test_opened() -> Iterator[None]:
    """Set up after the module fixtures: it closes only the clients and worlds of this test."""
    mark = OPENED.mark()
    yield
    OPENED.close_since(mark)


@pytest.fixture
def database(pg_uri: str) -> Iterator[str]:
    conninfo = clone_database(pg_uri)
    yield conninfo
    drop_database(pg_uri, conninfo_to_dict(conninfo)["dbname"])


def module_stack(pg_uri: str, **settings: object) -> Iterator[tuple[ServerThread, Client]]:
    """A control plane on its own cloned database, with a root client; `settings` override the
    defaults (e.g. clock_control=True for a module that moves compute_now())."""
    yield from _stack_on_clone(pg_uri, lambda conninfo: Settings(database_url=conninfo, **settings))


def _stack_on_clone(pg_uri: str, settings: Callable[[str], Settings]) -> Iterator[tuple[ServerThread, Client]]:
    conninfo = clone_database(pg_uri)
    server = ServerThread(conninfo, settings(conninfo))
    root = Client(server.endpoint, bootstrap.ensure_root(conninfo))
    try:
        yield server, root
    finally:
        root.close()
        server.stop()
        drop_database(pg_uri, conninfo_to_dict(conninfo)["dbname"])


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri)


@pytest.fixture
def server(stack: tuple[ServerThread, Client]) -> ServerThread:
    """The module's control plane (in-process), for what a test asks of it directly."""
    return stack[0]


@pytest.fixture
def world(request: pytest.FixtureRequest, stack: tuple[ServerThread, Client]) -> Iterator[World]:
    """A tenant with a pool on the module's control plane. In a module whose control plane moves
    the clock (clock_control), each test gets a database and control plane of its own, with the
    module's settings: advancing the clock must not fire the work items earlier tests left."""
    server, root = stack
    if not server.settings.clock_control:
        w = make_world(server.endpoint, root, server.conninfo)
        yield w
        w.close()
        return
    own = _stack_on_clone(request.getfixturevalue("pg_uri"),
                          lambda conninfo: dataclasses.replace(server.settings, database_url=conninfo))
    own_server, own_root = next(own)
    try:
        w = make_world(own_server.endpoint, own_root, own_server.conninfo)
        yield w
        w.close()
    finally:
        own.close()  # runs the generator's finally: stop the server, drop the database


@pytest.fixture
def clock_stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    """A control plane with clock control on a database of this test's own: moving its clock
    wakes only this test's work items, never the deadlines earlier tests left in a shared one."""
    yield from module_stack(pg_uri, clock_control=True)


@pytest.fixture
def clock_world(clock_stack: tuple[ServerThread, Client]) -> Iterator[World]:
    server, root = clock_stack
    w = make_world(server.endpoint, root, server.conninfo)
    yield w
    w.close()
