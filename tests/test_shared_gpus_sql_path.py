"""The shared-GPU and per-model quota tests again with the capacity index off
(BC_PLACEMENT_INDEX=off): the SQL shortlist, diagnostics and pool-model reads serve MIG instances,
slots and model charges too."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import module_stack
from tests.support import Client, ServerThread
from tests.test_quota_model import *  # noqa: F403 - the same tests, on the stack below
from tests.test_shared_gpus import *  # noqa: F403


@pytest.fixture(scope="module")
def stack(pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, placement_index=False)


def test_this_module_plans_with_sql(stack: tuple[ServerThread, Client]) -> None:
    assert stack[0].app.runtime.capacity is None
