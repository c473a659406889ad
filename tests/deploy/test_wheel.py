"""The wheel is the product: every file the packages read at run time is in it.

The wheel is `make wheel`'s (built from a copy of the files git would commit, so neither a
stale `build/` nor an untracked file can hide a gap), checked two ways: the files the package's data
readers open when they run (recorded by an audit hook) must all be in it, and every file
tracked under a package folder must be in it or named below as not needed at run time.
`make check-install` then serves from the installed wheel, outside the checkout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = [p.rstrip("*") for p in
            PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
# Tracked under a package folder, but never read by the installed package.
NOT_SHIPPED = {
    "planner/data/models/README.md": "says where the model configs come from",
}

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The names in the wheel `make wheel` builds."""
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run(["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(out)],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHON": sys.executable})
    assert built.returncode == 0, built.stderr
    with zipfile.ZipFile(built.stdout.strip()) as zf:
        return set(zf.namelist())


def _kernel_sources() -> None:
    from engine.kernels import kernel_source

    kernel_source()


def _planner_data() -> None:
    from planner.specs import accelerator_table, load_model_shape

    accelerator_table()
    for path in (ROOT / "planner" / "data" / "models").glob("*.json"):
        load_model_shape(path.stem)


def _opened_in_packages(reader: Callable[[], None]) -> set[str]:
    """The files under the package folders that `reader` opens, relative to the root."""
    opened: set[str] = set()

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str | Path):
            path = Path(args[0]).resolve()
            if path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in PACKAGES:
                opened.add(path.relative_to(ROOT).as_posix())

    recording = [True]
    sys.addaudithook(lambda event, args: hook(event, args) if recording[0] else None)
    try:
        reader()
    finally:
        recording[0] = False  # audit hooks cannot be removed: this one goes quiet
    return opened


@pytest.mark.parametrize("reader", [_kernel_sources, _planner_data],
                         ids=["kernel sources", "planner data"])
def test_every_file_a_reader_opens_is_in_the_wheel(wheel_files: set[str], reader):
    opened = {name for name in _opened_in_packages(reader)
              if not name.endswith((".py", ".pyc"))}
    assert opened, "the reader opened no data file: the recording is broken"
    assert opened <= wheel_files, f"read at run time, missing from the wheel: " \
                                  f"{sorted(opened - wheel_files)}"


def test_every_tracked_package_file_is_in_the_wheel(wheel_files: set[str]):
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *PACKAGES],
                             cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert "engine/csrc/common.h" in tracked
    missing = {name for name in tracked if name not in wheel_files} - set(NOT_SHIPPED)
    assert not missing, f"tracked package files the wheel leaves out: {sorted(missing)}"
    assert not set(NOT_SHIPPED) & wheel_files


def test_the_wheel_holds_the_product_only(wheel_files: set[str]):
    tops = {name.split("/")[0] for name in wheel_files if "/" in name}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES)
