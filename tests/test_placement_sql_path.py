"""The placement tests again with the capacity index off (BC_PLACEMENT_INDEX=off): the SQL
shortlist stays a tested path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import module_stack
from tests.support import Client, ServerThread
from tests.test_placement import *  # noqa: F403 - the same tests, on the stack below


@pytest.fixture(scope="module", params=["inline", "lease"])
def stack(request: pytest.FixtureRequest, pg_uri: str) -> Iterator[tuple[ServerThread, Client]]:
    yield from module_stack(pg_uri, placement_index=False, default_placer=request.param)


def test_this_module_plans_with_sql(stack: tuple[ServerThread, Client]) -> None:
    assert stack[0].app.runtime.capacity is None
