"""The layering `make lint` checks, as allow-lists: a package imports, of the project's own
modules, only those its contract in pyproject.toml ([tool.importlinter]) names, so a new
dependency between packages is a one-line change someone reviews, never an accident.

Not shipped in the wheel: only import-linter loads it (`contract_types`, `PYTHONPATH=.`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grimp
from importlinter import Contract, ContractCheck, fields, output


@dataclass(frozen=True)
class Breach:
    """One import the contract does not allow."""

    importer: str
    imported: str
    line_number: int | None
    line_contents: str

    def __str__(self) -> str:
        if self.line_number is None:
            return f"{self.importer} -> {self.imported}"
        return f"{self.importer} -> {self.imported} (l.{self.line_number}: {self.line_contents})"


class AllowedImportsContract(Contract):
    """Every module of `importer` imports, of the project's modules, only the allowed ones.

    Configuration options:
        - importer: the package whose modules are checked.
        - allowed: project modules it may import, each with every module under it.
        - allowed_exactly: project modules it may import by themselves, not the modules
          under them (`engine`: the names `engine/__init__.py` exports, never
          `engine.scheduler`).

    A project module is one under the session's `root_packages`; the importer's own
    modules are always allowed, and third-party libraries are left to `forbidden`
    contracts. Direct imports only: the `layers` contract follows chains.
    """

    type_name = "allowed_imports"

    importer = fields.ModuleField()
    allowed = fields.ListField(subfield=fields.ModuleField(), required=False, default=[])
    allowed_exactly = fields.ListField(subfield=fields.ModuleField(), required=False,
                                       default=[])

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        source = self.importer.name
        if source not in graph.modules:
            raise ValueError(f"{self.name}: importer {source!r} is not in the import graph")
        breaches = []
        for importer in sorted({source, *graph.find_descendants(source)}):
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if not self._allows(imported):
                    breaches += _breaches(graph, importer, imported)
        return ContractCheck(
            kept=not breaches, metadata={"breaches": breaches},
            warnings=[f"allowed module {name!r} is not in the project (yet?)"
                      for name in self._entries() if name not in graph.modules])

    def render_broken_contract(self, check: ContractCheck) -> None:
        output.print_error(f"{self.importer.name} may import only {', '.join(self._entries())} "
                           "of the project; it imports:", bold=False)
        output.new_line()
        for breach in check.metadata["breaches"]:
            output.print_error(f"- {breach}", bold=False)
        output.new_line()

    def _allows(self, imported: str) -> bool:
        """Outside the project, inside the importer, or named by `allowed`/`allowed_exactly`."""
        if imported.split(".")[0] not in self.session_options.get("root_packages", []):
            return True
        return (_within(imported, self.importer.name)
                or any(_within(imported, m.name) for m in self.allowed)
                or any(imported == m.name for m in self.allowed_exactly))

    def _entries(self) -> list[str]:
        return [m.name for m in [*self.allowed, *self.allowed_exactly]]


def _breaches(graph: grimp.ImportGraph, importer: str, imported: str) -> list[Breach]:
    """One `Breach` per import statement (a graph built by hand may have no details)."""
    details = graph.get_import_details(importer=importer, imported=imported)
    return [Breach(importer, imported, d["line_number"], d["line_contents"]) for d in details
            ] or [Breach(importer, imported, None, "")]


def _within(module: str, package: str) -> bool:
    """`module` is `package` or a module under it."""
    return module == package or module.startswith(package + ".")
