"""The platform wheels install wherever torch does (glibc 2.28, manylinux_2_28) and say so: the host
library needs nothing newer, whatever glibc and compiler built it (issue #49, item 1), and a kernel
library is placed by auditwheel on that floor, without its "couldn't detect wheel libc" guess
(item 2). Each wheel is checked as the build checks it (``tools.manylinux``, ``auditwheel``)."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.test_wheels import BUILD, NATIVE, VERSIONS

ROOT = Path(__file__).resolve().parents[2]
#: torch's own floor: its manylinux_2_28 wheels are what every package here depends on.
FLOOR_GLIBC = 28
#: The wheels whose floor the packages inherit: every package needs torch, the kernels load the
#: DSL's runtime (one of its libs wheels) and TVM-FFI's library.
DEPENDENCIES = ("torch", "apache-tvm-ffi", "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")


def auditwheel() -> str:
    found = shutil.which("auditwheel", path=str(Path(sys.executable).parent)) or shutil.which("auditwheel")
    if found is None:
        pytest.skip("auditwheel is not installed (nox -s tests installs it)")
    return found


def show(wheel: Path) -> str:
    """``auditwheel show``'s report (stdout and stderr: its warnings are logged)."""
    done = subprocess.run([auditwheel(), "show", str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return " ".join((done.stdout + done.stderr).split())  # its report wraps lines


def glibc_minor(report: str) -> int:
    """The glibc minor version of the manylinux tag ``auditwheel show`` finds for the wheel: the
    tag it is consistent with, or the one its symbol versions constrain it to (the newer)."""
    minors = [int(minor) for minor in re.findall(r'platform tag(?: to|:) "manylinux_2_(\d+)_x86_64"', report)]
    assert minors, report
    return max(minors)


@pytest.fixture(scope="module")
def core_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """mhc-core's wheel as hatch writes it (``linux_x86_64``; its host library built by its build hook)."""
    pytest.importorskip("hatchling", reason="hatchling builds the wheel (nox -s tests installs it)")
    out = tmp_path_factory.mktemp("core")
    built = subprocess.run(
        [sys.executable, "-c", BUILD, str(out)], cwd=ROOT / "packages" / "mhc-core", capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return out / built.stdout.strip().splitlines()[-1]


def library(wheel: Path, name: str) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name)


def test_the_host_library_needs_nothing_newer_than_glibc_2_28(core_wheel: Path) -> None:
    """GLIBC_2.34 (dlopen), GLIBCXX_3.4.29 and the like, which a new toolchain asks for, are not needed:
    auditwheel places the wheel at manylinux_2_28 or older."""
    report = show(core_wheel)
    assert glibc_minor(report) <= FLOOR_GLIBC, report
    assert "couldn't detect wheel libc" not in report, report


def test_the_build_tags_the_core_wheel_with_the_floor(core_wheel: Path, tmp_path: Path) -> None:
    """``nox -s build``'s step: the wheel rewritten as manylinux_2_28, nothing copied in, the library unchanged."""
    from tools import manylinux

    auditwheel()
    wheel = Path(shutil.copy(core_wheel, tmp_path))
    repaired, output = manylinux.retag(wheel)
    assert repaired.name == f"mhc_core-{VERSIONS['mhc-core']}-py3-none-manylinux_2_28_x86_64.whl", output
    assert not wheel.exists()
    assert manylinux.UNPLACED not in output
    assert library(repaired, NATIVE[0]) == library(core_wheel, NATIVE[0])
    with zipfile.ZipFile(repaired) as archive:
        assert not [name for name in archive.namelist() if ".libs/" in name], "auditwheel copied a library in"
        lines = archive.read(f"mhc_core-{VERSIONS['mhc-core']}.dist-info/WHEEL").decode().splitlines()
    assert [line for line in lines if line.startswith("Tag:")] == ["Tag: py3-none-manylinux_2_28_x86_64"]


def kernel_wheel(folder: Path) -> Path:
    """A model-style wheel as hatch writes one that carries kernels: a library linked the way
    ``tools.export_kernels`` links the exported kernels (``artifacts.link``), in ``kernels/<arch>/``."""
    from mhc_core.host.binaries import artifacts

    if shutil.which("cc") is None:
        pytest.skip("linking a kernel library needs a C compiler (cc)")
    source = folder / "kernel.c"
    source.write_text("int mhc_floor_probe(int value) { return value + 1; }\n")  # calls nothing in libc
    subprocess.run(["cc", "-c", "-fPIC", str(source), "-o", str(folder / "kernel.o")], check=True)
    artifacts.link([str(folder / "kernel.o")], folder / "libmhc_probe_sm_90a.so")
    wheel = folder / "mhc_probe-0.1.0-py3-none-linux_x86_64.whl"
    info = "mhc_probe-0.1.0.dist-info"
    files = {
        "mhc_probe/__init__.py": b"",
        "mhc_probe/kernels/sm_90a/libmhc_probe_sm_90a.so": (folder / "libmhc_probe_sm_90a.so").read_bytes(),
        f"{info}/METADATA": b"Metadata-Version: 2.4\nName: mhc-probe\nVersion: 0.1.0\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-linux_x86_64\n",
    }
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{info}/RECORD", "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]))
    return wheel


def test_a_kernel_library_is_placed_at_the_floor_without_a_guess(tmp_path: Path) -> None:
    """A kernel calls nothing in libc: its library, linked as the export links it, still names libc, so
    auditwheel places the wheel instead of guessing (manylinux1 before), and the build tags it with
    the floor its dependencies have."""
    wheel = kernel_wheel(tmp_path)
    report = show(wheel)
    assert "couldn't detect wheel libc" not in report, report
    from tools import manylinux

    repaired, output = manylinux.retag(wheel)
    assert repaired.name == "mhc_probe-0.1.0-py3-none-manylinux_2_28_x86_64.whl", output
    assert manylinux.UNPLACED not in output, output


def test_the_floor_is_the_dependencies_floor() -> None:
    """``tools.manylinux.FLOOR`` is the newest of the floors of the installed wheels the packages need
    (each wheel's oldest tag): below it one of them does not install."""
    from tools import manylinux

    floors = {}
    for name in DEPENDENCIES:
        try:
            wheel = importlib.metadata.distribution(name).read_text("WHEEL") or ""
        except importlib.metadata.PackageNotFoundError:
            continue
        minors = [int(minor) for minor in re.findall(r"^Tag: .*-manylinux_2_(\d+)_x86_64$", wheel, re.MULTILINE)]
        if minors:
            floors[name] = min(minors)
    if "torch" not in floors:
        pytest.skip("torch is not installed from a manylinux wheel here")
    newest = max(floors.values())
    assert (newest, manylinux.FLOOR) == (FLOOR_GLIBC, f"manylinux_2_{FLOOR_GLIBC}"), floors
