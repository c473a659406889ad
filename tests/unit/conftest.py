"""The unit tests' shared fixtures (beside `tests/conftest.py`'s)."""

from __future__ import annotations

from typing import Any

import pytest

import cluster.serve
from tests.conftest import clear_flag_env


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replaces `cluster.serve.run`: the options `pdcluster serve` would run are kept,
    nothing is started; the environment holds none of the serve flags' variables."""
    seen: list[Any] = []

    async def run(options: Any) -> None:
        seen.append(options)

    monkeypatch.setattr(cluster.serve, "run", run)
    clear_flag_env(monkeypatch)
    return seen
