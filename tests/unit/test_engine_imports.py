"""The engine's modules import each other without a circle: every import counts, those
inside functions and under `TYPE_CHECKING` too, since a circle hidden there is still one
design knot (each module needs the other to be understood, tested or replaced)."""

from __future__ import annotations

import itertools

import grimp


def _cycles(graph: grimp.ImportGraph, package: str) -> list[tuple[str, ...]]:
    """One shortest import circle through each direct import that closes one, each circle
    once (as its modules, starting from the smallest name)."""
    found: dict[frozenset[str], tuple[str, ...]] = {}
    for importer in sorted(graph.modules):
        if importer != package and not importer.startswith(package + "."):
            continue
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is None:
                continue
            cycle = (importer, *back)  # importer -> imported -> ... -> importer
            key = frozenset(cycle)
            if key not in found or len(cycle) < len(found[key]):
                found[key] = cycle
    return sorted(found.values())


def _describe(graph: grimp.ImportGraph, cycle: tuple[str, ...]) -> str:
    steps = []
    for importer, imported in itertools.pairwise(cycle):
        lines = sorted({d["line_number"] for d in graph.get_import_details(
            importer=importer, imported=imported)})
        where = f" (line {', '.join(map(str, lines))})" if lines else ""
        steps.append(f"{importer} -> {imported}{where}")
    return "; ".join(steps)


def test_no_import_cycle_inside_engine() -> None:
    graph = grimp.build_graph("engine")  # TYPE_CHECKING and in-function imports included
    cycles = _cycles(graph, "engine")
    assert not cycles, "import circles inside engine:\n" + "\n".join(
        _describe(graph, c) for c in cycles)


def test_the_check_finds_a_circle() -> None:
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert _cycles(graph, "pkg") == []
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _cycles(graph, "pkg") == [("pkg.a", "pkg.b", "pkg.c", "pkg.a")]
