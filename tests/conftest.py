"""Shared fixtures: the session-scoped rank pools and the import path for examples/."""

from __future__ import annotations

import os
import sys
from typing import Callable, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
for path in (HERE, EXAMPLES):
    if path not in sys.path:
        sys.path.insert(0, path)

from rank_pool import DEATHS, RankPool  # noqa: E402


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[[int], RankPool]]:
    """``ranks(n)`` is a pool of ``n`` gloo ranks, started on first use and kept for the session."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    get.pools = pools  # type: ignore[attr-defined]

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(autouse=True)
def _refresh_pools(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, rebuild the pools whose ranks hold too many process groups (`RankPool.refresh`)."""
    yield
    if "ranks" in request.fixturenames:
        get = request.getfixturevalue("ranks")
        for pool in get.pools.values():  # type: ignore[attr-defined]
            pool.refresh()


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """Pool ranks that died between tests (the next test ran on a rebuilt pool), or of a signal
    during a call that then ran again (`RankPool.run`)."""
    if DEATHS:
        terminalreporter.section("rank processes that died outside a test's control (the pool was rebuilt)")
        for line in DEATHS:
            terminalreporter.line(line)
