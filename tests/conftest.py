"""Fixtures: one embedded PostgreSQL per session with a migrated template database; per module a
database cloned from the template and a real control plane on a loopback port."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from controlplane import bootstrap, db
from controlplane.config import Settings
from controlplane.logs import configure_logging
from tests.support import Client, ServerThread, World, make_world

TEMPLATE = "bc_template"


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
    return uri


def clone_database(pg_uri: str) -> str:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_uri, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    return db.with_database(pg_uri, name)


@pytest.fixture
def database(pg_uri: str) -> str:
    return clone_database(pg_uri)


def module_stack(pg_uri: str, **settings: object) -> Iterator[tuple[ServerThread, Client]]:
    """A control plane on its own cloned database, with a root client; `settings` override the
    defaults (e.g. clock_control=True for a module that moves compute_now())."""
    conninfo = clone_database(pg_uri)
    server = ServerThread(conninfo, Settings(database_url=conninfo, **settings))
    root = Client(server.endpoint, bootstrap.ensure_root(conninfo))
    try:
        yield server, root
    finally:
        root.close()
        server.stop()


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri)


@pytest.fixture
def world(stack: tuple[ServerThread, Client]) -> World:
    server, root = stack
    return make_world(server.endpoint, root, server.conninfo)
