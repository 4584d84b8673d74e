"""The connection file says where the client sends its token: only its user may have written it.

`.dev/connection.json` is found relative to the working directory, so a repository one clones
could carry one naming an endpoint of its author's; `--token` (or the file's own token) would go
there. A file the client finds by itself must be the user's and private (0600, as `dev` writes
it; a checked-out file is 0644); one named by `--connection` must be writable by its user alone.
Each test listens on a real loopback socket where the file points and checks whether the client
connected to it.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.test_hostile_surface import assert_usage_error

REPO = pathlib.Path(__file__).resolve().parents[1]
CLI_TIMEOUT_S = 60
TOKEN = "bct_planted0000.secret-of-the-user"


class Listener:
    """Where a file points: a loopback socket that counts the connections made to it and closes
    each at once (the client fails fast with UNAVAILABLE)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.endpoint = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.connections = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)


@pytest.fixture
def listener() -> Iterator[Listener]:
    sock = Listener()
    yield sock
    sock.close()


def _write(path: pathlib.Path, endpoint: str, mode: int, **extra: str) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"endpoint": endpoint, "tenantId": "t1", "poolId": "p1", **extra}))
    path.chmod(mode)
    return path


def _cli(cwd: pathlib.Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    environ.pop("BC_DATA_DIR", None)
    environ.pop("DATABASE_URL", None)
    environ.update(env)
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


@pytest.mark.parametrize("token_in", ["flag", "file"])
def test_a_planted_dev_connection_file_in_the_working_directory_gets_no_token(
    tmp_path: pathlib.Path, listener: Listener, token_in: str
) -> None:
    """A checked-out `.dev/connection.json` (0644) is refused before anything is sent."""
    extra = {"token": TOKEN} if token_in == "file" else {}
    _write(tmp_path / ".dev" / "connection.json", listener.endpoint, 0o644, **extra)
    flags = ["--token", TOKEN] if token_in == "flag" else []
    done = _cli(tmp_path, "get", "rsv_x", *flags)
    assert_usage_error(done, "chmod 600")
    assert listener.connections == 0, "the client connected where the planted file pointed"


def test_a_private_dev_connection_file_is_used(tmp_path: pathlib.Path, listener: Listener) -> None:
    """The file `dev` writes (0600, the user's) still takes the client where it says."""
    _write(tmp_path / ".dev" / "connection.json", listener.endpoint, 0o600, token=TOKEN)
    done = _cli(tmp_path, "get", "rsv_x")
    assert done.returncode != 2, done.stderr
    assert listener.connections > 0, (done.returncode, done.stderr)


def test_a_file_found_under_bc_data_dir_must_be_private_too(tmp_path: pathlib.Path, listener: Listener) -> None:
    data = tmp_path / "data"
    _write(data / "connection.json", listener.endpoint, 0o640, token=TOKEN)
    assert_usage_error(_cli(tmp_path, "get", "rsv_x", BC_DATA_DIR=str(data)), "chmod 600")
    assert listener.connections == 0


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("named", [False, True], ids=["found", "named"])
def test_a_connection_file_of_another_user_is_refused(
    tmp_path: pathlib.Path, listener: Listener, named: bool
) -> None:
    path = _write(tmp_path / ".dev" / "connection.json", listener.endpoint, 0o600, token=TOKEN)
    os.chown(path, 65534, 65534)
    flags = ["--connection", str(path)] if named else []
    assert_usage_error(_cli(tmp_path, "get", "rsv_x", *flags), "another user")
    assert listener.connections == 0


def test_a_named_connection_file_others_can_write_is_refused(tmp_path: pathlib.Path, listener: Listener) -> None:
    path = _write(tmp_path / "shared.json", listener.endpoint, 0o666, token=TOKEN)
    assert_usage_error(_cli(tmp_path, "get", "rsv_x", "--connection", str(path)), "chmod go-w")
    assert listener.connections == 0


def test_a_named_connection_file_others_can_read_is_used(tmp_path: pathlib.Path, listener: Listener) -> None:
    """A file the user names is their choice: readable by others is allowed, as before."""
    path = _write(tmp_path / "mine.json", listener.endpoint, 0o644, token=TOKEN)
    done = _cli(tmp_path, "get", "rsv_x", "--connection", str(path))
    assert done.returncode != 2, done.stderr
    assert listener.connections > 0, (done.returncode, done.stderr)


def test_the_mcp_server_refuses_a_planted_dev_connection_file(tmp_path: pathlib.Path, listener: Listener) -> None:
    _write(tmp_path / ".dev" / "connection.json", listener.endpoint, 0o644, token=TOKEN)
    assert_usage_error(_cli(tmp_path, "mcp"), "chmod 600")
    assert listener.connections == 0
