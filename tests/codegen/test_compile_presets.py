"""``python3 -m tools.compile_presets``: compiles (without a GPU), deduplicates, skips kernels not written yet."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from tests.codegen.support import ROOT
from tools import compile_presets

PUBLISH = (
    "mhc_core.device.publish:PublishKernel",
    {"hidden": 1024, "tp": 2, "threads": 128, "trigger": "after_stores"},
)
LATER = "mhc_core.not_written_yet:FutureKernel"


def fake_preset(tp: int) -> SimpleNamespace:
    """A generated module's surface: PRESET.archs, GEOMETRY, KERNELS, kernels(arch, names)."""
    from mhc_core.host.binaries.compiler import kernel_from_spec

    specs: dict[str, tuple[str, dict[str, Any]]] = {
        "publish": (PUBLISH[0], {**PUBLISH[1], "store": "unicast"}),
        f"publish_tp{tp}": (PUBLISH[0], {**PUBLISH[1], "tp": tp, "store": "unicast"}),
        "future": (LATER, {"hidden": 1024}),
    }
    kernels = {"sm_90a": specs}
    return SimpleNamespace(
        PRESET=SimpleNamespace(archs=("sm_90a",)),
        GEOMETRY={},
        KERNELS=kernels,
        kernels=lambda arch, names: {name: kernel_from_spec(*kernels[arch][name]) for name in names},
    )


def test_dedupes_and_skips_missing_classes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    presets = [("dsv41", "fake-a", fake_preset(4)), ("dsv41", "fake-b", fake_preset(8))]
    monkeypatch.setattr(compile_presets, "select_presets", lambda models, wanted: presets)
    assert compile_presets.main(["--model", "dsv41"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"not implemented yet: {LATER}") == 1
    rows = [line.split() for line in out.splitlines() if line.startswith("dsv41.fake-")]
    assert [row[:3] for row in rows] == [
        ["dsv41.fake-a", "publish", "sm_90a"],
        ["dsv41.fake-a", "publish_tp4", "sm_90a"],
        ["dsv41.fake-b", "publish", "sm_90a"],
        ["dsv41.fake-b", "publish_tp8", "sm_90a"],
    ]
    assert rows[2][-5:] == ["-", "same", "as", "dsv41.fake-a", "publish"]
    for row in rows:
        assert row[4] == "0/0" and row[5] == "0", row  # no spills, no stack
        assert row[6:8] == ["0", "static"]
    assert "3 distinct kernels compiled for 4 preset kernels" in out


def test_missing_class() -> None:
    assert compile_presets.missing_class("mhc_core.not_written_yet:FutureKernel")
    assert compile_presets.missing_class("mhc_nothing.kernel:Kernel")
    assert compile_presets.missing_class("mhc_core.device.publish:NoSuchKernel")
    assert not compile_presets.missing_class("mhc_core.device.publish:PublishKernel")


def test_dynamic_shared_memory_comes_from_the_geometry() -> None:
    geometry = {"shared_bytes": 36, "grouped_shared_bytes": {4: 100, 8: 200}}
    assert compile_presets.dynamic_shared("dsv41", "collective", geometry) == 36
    assert compile_presets.dynamic_shared("glm5", "boundary", geometry) == 36
    assert compile_presets.dynamic_shared("glm5", "boundary_x8", geometry) == 200
    assert compile_presets.dynamic_shared("glm5", "publish", geometry) is None


def test_one_real_preset() -> None:
    """The command itself, on one DSV4.1 preset: every kernel compiles for sm_90a without spills."""
    result = subprocess.run(
        [sys.executable, "-m", "tools.compile_presets", "--preset", "dsv41.h200-tp2-h5120"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("dsv41.h200-tp2-h5120 ")]
    assert [row[1] for row in rows] == [
        "publish",
        "publish_multicast",
        "finalize",
        "collective",
        "collective_persistent",
    ]
    from mhc_dsv41.presets import h200_tp2_h5120

    assert rows[-2][6:8] == [str(h200_tp2_h5120.GEOMETRY["shared_bytes"]), "dyn"]
    assert rows[-1][6:8] == [str(h200_tp2_h5120.GEOMETRY["persistent_shared_bytes"]), "dyn"]


def test_unknown_preset() -> None:
    with pytest.raises(SystemExit, match="unknown preset"):
        compile_presets.select_presets(["dsv41"], ["no-such-preset"])


def test_names_the_copy_it_imports_and_refuses_unknown_presets() -> None:
    """The checkout's sources win over an installed wheel, and the tool says so; an unknown preset
    name is an error (exit status 1 and its name), never a silent skip."""
    command = [sys.executable, "-m", "tools.compile_presets", "--preset", "dsv41.no-such-preset"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode != 0
    assert "unknown preset(s) dsv41.no-such-preset" in done.stderr
    for package, distribution in (("mhc_core", "mhc-core"), ("mhc_dsv41", "mhc-dsv41"), ("mhc_glm5", "mhc-glm5")):
        expected = f"{package}: {ROOT / 'packages' / distribution / 'src' / package} (the checkout)"
        assert expected in done.stdout.splitlines(), done.stdout


def test_every_preset_kernel_compiles_without_spills() -> None:
    """What ``nox -s build`` runs first: every preset kernel of every arch compiles, with no spill and
    no local memory (the tool's exit status). CI does not run the build, so this test guards it."""
    command = [sys.executable, "-m", "tools.compile_presets"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 kernel class(es) not implemented yet" in done.stdout
