"""Issue #48: the noxfile's sessions per package and the multi-GPU matrix, read from nox's own registry
(``nox -l`` lists the same), and what ``build_<key>`` runs, recorded by a stand-in session (nothing is
installed or built)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MATRIX = [f"multigpu(tp={tp}, mode={mode!r})" for mode in ("gpus", "procs-per-gpu") for tp in (2, 4, 8)]


@pytest.fixture(scope="module")
def noxfile() -> ModuleType:
    pytest.importorskip("nox", reason="the noxfile imports nox")
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listed() -> list[str]:
    done = subprocess.run([sys.executable, "-m", "nox", "-l"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return [line[2:].split(" [")[0].split(" -> ")[0] for line in done.stdout.splitlines() if line[:2] in ("* ", "- ")]


def test_nox_lists_every_package_session_and_the_matrix(noxfile: ModuleType) -> None:
    pytest.importorskip("nox")
    sessions = listed()
    for key in noxfile.PACKAGE_KEYS:
        for kind in ("build", "lint", "tests"):
            assert f"{kind}_{key}" in sessions, sessions
    assert set(noxfile.PACKAGE_KEYS) == {"core", "dsv41", "glm5"}
    assert [name for name in sessions if name.startswith("multigpu")] == MATRIX
    assert {"build", "lint", "tests(versions='highest')"} <= set(sessions)


class Recorder:
    """Stands in for a nox session: records what it would run and install."""

    def __init__(self) -> None:
        self.posargs: list[str] = []
        self.commands: list[tuple[str, ...]] = []

    def install(self, *args: str) -> None:
        pass

    def run(self, *args: str, **options: Any) -> None:
        self.commands.append(args)

    def log(self, *args: Any) -> None:
        pass


def registered(noxfile: ModuleType, name: str) -> Any:
    from nox.registry import get

    return get()[name]


def test_build_one_package_builds_its_wheel_alone(noxfile: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nox -s build_dsv41``: generate, compile and export DSV4.1's presets only, build its wheel only."""
    session = Recorder()
    monkeypatch.setattr(noxfile, "ROOT", ROOT / "no-dist-here")  # no wheel found to retag or list
    registered(noxfile, "build_dsv41")(session)
    assert session.commands == [
        ("python", "-m", "codegen"),
        ("python", "-m", "tools.compile_presets", "--model", "dsv41"),
        ("python", "-m", "tools.export_kernels", "--model", "dsv41"),
        ("python", "-m", "build", "--wheel", "--no-isolation", "--outdir", "dist", "packages/mhc-dsv41"),
    ]
    everything = Recorder()
    registered(noxfile, "build")(everything)
    built = [command[-1] for command in everything.commands if command[2] == "build"]
    assert built == ["packages/mhc-core", "packages/mhc-dsv41", "packages/mhc-glm5"]
    assert ("python", "-m", "tools.compile_presets") in everything.commands  # every model at once


def test_lint_runs_every_package_lint(noxfile: ModuleType) -> None:
    everything = Recorder()
    registered(noxfile, "lint")(everything)
    for key in noxfile.PACKAGE_KEYS:
        one = Recorder()
        registered(noxfile, f"lint_{key}")(one)
        assert all(command in everything.commands for command in one.commands), key
    rest = everything.commands[-2]
    assert rest[:2] == ("ruff", "check") and rest[-1] == "." and "packages/mhc-glm5" in rest
