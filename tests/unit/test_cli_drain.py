"""`pdcluster drain`'s flags and answers, without a Ray cluster: what reaches
`cluster.frontdoor.drain`, and what the command prints and exits with for each outcome
(the drain itself, on a real detached cluster: tests/e2e/test_frontdoor.py)."""

from __future__ import annotations

from typing import Any

import pytest
import ray

import cluster.frontdoor
from commands.cli import main


@pytest.fixture
def drained(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Replaces `cluster.frontdoor.drain`: the arguments it got; no request was left."""
    calls: list[tuple[Any, ...]] = []

    def drain(*args: Any) -> int:
        calls.append(args)
        return 0

    monkeypatch.setattr(cluster.frontdoor, "drain", drain)
    return calls


def test_defaults_ask_the_front_door_for_its_own_drain_timeout(
        drained: list[tuple[Any, ...]], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["drain"]) == 0
    assert drained == [(None, "pdcluster", None)]
    assert capsys.readouterr().out == ("drained 'pdcluster': refusing new requests until its "
                                       "front door's process ends\n")


def test_flags_reach_the_drain(drained: list[tuple[Any, ...]]) -> None:
    assert main(["drain", "--address", "ray://head:10001", "--name", "mine",
                 "--drain_timeout", "12.5"]) == 0
    assert drained == [("ray://head:10001", "mine", 12.5)]


def test_requests_cut_at_the_timeout_are_counted(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cluster.frontdoor, "drain", lambda *_: 3)
    assert main(["drain", "--drain-timeout", "0"]) == 0
    assert capsys.readouterr().out.endswith("; 3 requests still running at the drain "
                                            "timeout\n")


def test_no_cluster_of_that_name(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The real `cluster.frontdoor.drain` on a Ray cluster (stood in for) that has no such
    actor: Ray's `get_actor` raises ValueError, the command says so and exits 1."""
    asked: list[str] = []

    def get_actor(name: str) -> Any:
        asked.append(name)
        raise ValueError(f"Failed to look up actor with name '{name}'")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    assert main(["drain", "--name", "gone"]) == 1
    assert asked == ["gone-frontdoor"]
    assert capsys.readouterr().err == "no detached cluster named 'gone'\n"


def test_a_front_door_that_does_not_serve_is_an_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def drain(*_: Any) -> int:
        raise RuntimeError("the front door does not serve (starting)")

    monkeypatch.setattr(cluster.frontdoor, "drain", drain)
    assert main(["drain"]) == 1
    assert capsys.readouterr().err == "error: the front door does not serve (starting)\n"


def test_a_negative_timeout_is_refused_before_ray_is_reached(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def unreachable(*_: Any, **__: Any) -> None:
        raise AssertionError("Ray reached")

    monkeypatch.setattr(ray, "init", unreachable)
    assert main(["drain", "--drain-timeout", "-1"]) == 2
    assert capsys.readouterr().err == "error: --drain-timeout must be >= 0, got -1\n"
