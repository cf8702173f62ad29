"""Issue #34, "shipped kernels and local edits": a kernel's key hashes the normal form of its modules'
sources (``ast.dump`` without docstrings), so a comment appended to the installed
``mhc_core/constants.py`` (which made all 5 kernels of ``h200-tp1-h5120`` count as missing), a
docstring or reformatting keeps every key; a change of code changes it, and
``artifacts.changed_sources`` (what the warning and the no-compiler error say) names the module.
Each case edits a copy of the packages' sources, hashed in a child process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNEL_MODULE = "mhc_dsv41.kernel"
HASH = """
import hashlib, json, sys
from mhc_core.host.binaries import artifacts
module = sys.argv[1]
assert artifacts.__file__.startswith(sys.argv[2]), artifacts.__file__
recorded = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
if recorded is not None:  # as a manifest built from the unedited sources would record them
    entry = artifacts.RecordedSources(recorded["hash"], tuple(recorded["forms"]), recorded["forms"], {})
    artifacts._recorded_sources = lambda: {module: [entry]}
forms = {name: hashlib.sha256(form).hexdigest() for name, form in artifacts.hashed_sources(module).items()}
changed = artifacts.changed_sources(module) if recorded is not None else []
print(json.dumps({"hash": artifacts.source_hash(module), "forms": forms, "changed": changed}))
"""


@pytest.fixture
def sources(tmp_path: Path) -> Path:
    """A copy of mhc-core's and mhc-dsv41's sources, to edit."""
    for package in ("mhc-core", "mhc-dsv41"):
        shutil.copytree(
            ROOT / "packages" / package / "src", tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    return tmp_path


def key_of(sources: Path, recorded: dict | None = None) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(str(sources / package) for package in ("mhc-core", "mhc-dsv41"))
    command = [sys.executable, "-c", HASH, KERNEL_MODULE, str(sources)]
    if recorded is not None:
        command.append(json.dumps(recorded))
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=sources)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def edit(sources: Path, relative: str, change) -> None:
    path = sources / relative
    path.write_text(change(path.read_text()))


CONSTANTS = "mhc-core/mhc_core/constants.py"
PUBLISH = "mhc-core/mhc_core/device/publish.py"


def test_a_comment_appended_to_constants_keeps_the_key(sources: Path) -> None:
    """The issue's edit: one comment at the end of the installed constants.py."""
    before = key_of(sources)
    assert "mhc_core.constants" in before["forms"]
    edit(sources, CONSTANTS, lambda text: text + "# a local note\n")
    assert key_of(sources)["hash"] == before["hash"]


def test_docstrings_and_formatting_keep_the_key(sources: Path) -> None:
    before = key_of(sources)
    edit(sources, PUBLISH, lambda text: '"""Another module docstring."""\n' + text.split('"""', 2)[2])
    edit(sources, CONSTANTS, lambda text: text.replace("\n\n", "\n\n\n").replace(" = ", "  =  "))
    assert key_of(sources)["hash"] == before["hash"]


def test_a_change_of_code_changes_the_key_and_is_named(sources: Path) -> None:
    before = key_of(sources)
    edit(sources, CONSTANTS, lambda text: text + "\nLOCAL_KNOB = 1\n")
    after = key_of(sources, recorded=before)
    assert after["hash"] != before["hash"]
    assert after["changed"] == ["mhc_core.constants (changed)"]


def test_unchanged_code_names_nothing(sources: Path) -> None:
    before = key_of(sources)
    edit(sources, CONSTANTS, lambda text: text + "# a comment\n")
    assert key_of(sources, recorded=before)["changed"] == []


def test_a_keys_symbol_is_its_json_sha256_pinned() -> None:
    """The symbol names every shipped and cached kernel: a change of how it is spelled would orphan
    them all. It is sha256 of the key's fields as sorted JSON (what ``dataclasses.asdict`` gives),
    non-ASCII and quotes in a config included, pinned to its value."""
    import dataclasses
    import hashlib

    from mhc_core.host.binaries.artifacts import KernelKey

    config = json.dumps({"hidden": 5120, "note": 'é " q'})
    key = KernelKey("mhc_dsv41.kernel:Kernel", config, "sm_90a", "4.8.1", "tvm-ffi/1", "ab" * 32)
    text = json.dumps(dataclasses.asdict(key), sort_keys=True)
    assert key.as_dict() == dataclasses.asdict(key)
    assert key.symbol == "mhc_" + hashlib.sha256(text.encode()).hexdigest()[:24] == "mhc_c812a311033136256ab8a13a"
