"""The allow-list contract `make lint` checks the layering with, on an import graph built by
hand: what it lets through, and what it reports when it breaks."""

from __future__ import annotations

import grimp
import pytest
from importlinter.domain.contract import InvalidContractOptions

from tests.import_contracts import AllowedImportsContract

ROOTS = ["engine", "router", "planner", "cluster", "bench"]


def graph(*imports: tuple[str, str, int, str]) -> grimp.ImportGraph:
    """The project's packages, `ray` as a third-party library, and `imports`."""
    g = grimp.ImportGraph()
    for module in ("engine", "engine.scheduler", "router", "router.placement", "router.logs",
                   "planner", "planner.autoscale_policy", "planner.plan", "cluster",
                   "cluster.pool", "cluster.serve", "bench"):
        g.add_module(module)
    g.add_module("ray", is_squashed=True)
    for importer, imported, line, text in imports:
        g.add_import(importer=importer, imported=imported, line_number=line,
                     line_contents=text)
    return g


def contract(importer: str, **options: list[str]) -> AllowedImportsContract:
    return AllowedImportsContract("allow-list", {"root_packages": ROOTS},
                                  {"importer": importer, **options})


CLUSTER = {"allowed": ["engine", "router", "planner.autoscale_policy"]}


def test_allowed_imports_own_modules_and_libraries_keep_it() -> None:
    g = graph(("cluster.serve", "planner.autoscale_policy", 3,
               "from planner.autoscale_policy import Autoscaler"),
              ("cluster.serve", "engine.scheduler", 4, "from engine import scheduler"),
              ("cluster.serve", "router.logs", 5, "from router.logs import configure"),
              ("cluster.serve", "cluster.pool", 6, "from cluster.pool import Pool"),
              ("cluster.pool", "ray", 1, "import ray"))
    check = contract("cluster", **CLUSTER).check(g, verbose=False)
    assert check.kept
    assert check.metadata["breaches"] == []
    assert check.warnings == []


def test_one_forbidden_import_breaks_it_and_is_named_with_its_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    g = graph(("cluster.serve", "planner.autoscale_policy", 3,
               "from planner.autoscale_policy import Autoscaler"),
              ("cluster.pool", "bench", 12, "import bench"))
    cluster = contract("cluster", **CLUSTER)
    check = cluster.check(g, verbose=False)
    assert not check.kept
    assert [str(b) for b in check.metadata["breaches"]] == [
        "cluster.pool -> bench (l.12: import bench)"]
    cluster.render_broken_contract(check)
    shown = capsys.readouterr().out
    assert "cluster may import only engine, router, planner.autoscale_policy" in shown
    assert "- cluster.pool -> bench (l.12: import bench)" in shown


def test_a_sibling_of_an_allowed_module_is_not_allowed() -> None:
    """`planner.autoscale_policy` lets the policy in, not the rest of the planner."""
    g = graph(("cluster", "planner.plan", 7, "from planner.plan import plan"))
    check = contract("cluster", **CLUSTER).check(g, verbose=False)
    assert [(b.importer, b.imported, b.line_number) for b in check.metadata["breaches"]] == [
        ("cluster", "planner.plan", 7)]


def test_allowed_exactly_takes_the_package_not_its_modules() -> None:
    public = ("router.placement", "engine", 2, "from engine import hash_blocks")
    internal = ("router.logs", "engine.scheduler", 9, "from engine.scheduler import Scheduler")
    router = contract("router", allowed_exactly=["engine"])
    assert router.check(graph(public), verbose=False).kept
    check = router.check(graph(public, internal), verbose=False)
    assert [str(b) for b in check.metadata["breaches"]] == [
        "router.logs -> engine.scheduler (l.9: from engine.scheduler import Scheduler)"]


def test_an_empty_allow_list_refuses_every_project_import() -> None:
    g = graph(("engine.scheduler", "router", 1, "import router"))
    check = contract("engine").check(g, verbose=False)
    assert [str(b) for b in check.metadata["breaches"]] == [
        "engine.scheduler -> router (l.1: import router)"]


def test_an_allowed_module_missing_from_the_project_is_a_warning() -> None:
    check = contract("bench", allowed=["router.client"]).check(graph(), verbose=False)
    assert check.kept
    assert check.warnings == ["allowed module 'router.client' is not in the project (yet?)"]


def test_a_misspelled_option_is_refused() -> None:
    with pytest.raises(InvalidContractOptions) as error:
        contract("cluster", allowed_exact=["engine"])
    assert "allowed_exact" in error.value.errors
