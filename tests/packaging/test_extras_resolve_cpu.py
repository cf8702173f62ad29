"""Each extra resolves to a matching pair of the DSL's CUDA libraries and ``cuda-bindings`` (issue #49,
item 3): ``[jit]`` brought the DSL compiler, which requires the CUDA 12 libraries, with
``cuda-bindings`` 13, the pairing ``[cu12]``'s ``<13`` exists to prevent.

pip resolves every package's extras with the index off, against local wheels: the packages' own
metadata (their pyproject.toml's dependencies and extras, as their wheels declare them) and stand-ins
of the DSL 4.8.1's distributions carrying the requirements that decide the pairing (checked against
the real ones where those are installed), with ``cuda-bindings`` 12 and 13 both on offer.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.packaging.test_wheels import PACKAGES, VERSIONS

ROOT = Path(__file__).resolve().parents[2]
DSL = "4.8.1"
#: The DSL's distributions, by the requirements of each that decide which CUDA libraries and bindings
#: come (pip's metadata of the 4.8.1 wheels; the rest, protobuf and the like, left out).
DSL_DISTRIBUTIONS = {
    "nvidia-cutlass-dsl": [f"nvidia-cutlass-dsl-libs-base=={DSL}", f"nvidia-cutlass-dsl-libs-cu12=={DSL}"],
    "nvidia-cutlass-dsl-libs-base": ["cuda-bindings>=12.8", f"nvidia-cutlass-dsl-libs-core=={DSL}"],
    "nvidia-cutlass-dsl-libs-core": ["cuda-bindings>=12.8"],
    "nvidia-cutlass-dsl-libs-cu12": ["cuda-bindings>=12.8", f"nvidia-cutlass-dsl-libs-base=={DSL}"],
    "nvidia-cutlass-dsl-libs-cu13": ["cuda-bindings>=12.8", f"nvidia-cutlass-dsl-libs-base=={DSL}"],
}
#: Stand-ins with no requirements of their own: both majors of the bindings, and the base dependencies.
LEAVES = {
    "cuda-bindings": ["12.9.4", "13.5.0"],
    "torch": ["2.13.0"],
    "apache-tvm-ffi": ["0.1.15.post2"],
    "numpy": ["2.3.0"],  # mhc-core's dependency (issue #49 item 6)
}
#: Every extra each package has, alone, and the compiler beside either runtime.
REQUESTS = ["cu12", "cu13", "jit", "jit,cu12"]
CUDA_LIBS = {"nvidia-cutlass-dsl-libs-cu12": 12, "nvidia-cutlass-dsl-libs-cu13": 13}


def stub_wheel(folder: Path, name: str, version: str, requires: list[str], extras: tuple[str, ...] = ()) -> None:
    """A wheel with metadata only: what pip reads to resolve."""
    stem = f"{name.replace('-', '_')}-{version}"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Provides-Extra: {extra}" for extra in extras] + [f"Requires-Dist: {pin}" for pin in requires]
    files = {
        f"{stem}.dist-info/METADATA": "\n".join(lines) + "\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        record = f"{stem}.dist-info/RECORD"
        archive.writestr(record, "".join(f"{path},,\n" for path in [*files, record]))


def declared(package: str) -> tuple[list[str], list[str]]:
    """``package``'s Requires-Dist and extras, from its pyproject.toml (what its wheel's METADATA says)."""
    with (ROOT / "packages" / package / "pyproject.toml").open("rb") as stream:
        project = tomllib.load(stream)["project"]
    requires = list(project["dependencies"])
    extras = project.get("optional-dependencies", {})
    requires += [f'{pin}; extra == "{extra}"' for extra, pins in extras.items() for pin in pins]
    return requires, list(extras)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("local-wheels")
    for package in PACKAGES:
        requires, extras = declared(package)
        stub_wheel(folder, package, VERSIONS[package], requires, tuple(extras))
    for name, requires in DSL_DISTRIBUTIONS.items():
        stub_wheel(folder, name, DSL, requires)
    for name, versions in LEAVES.items():
        for version in versions:
            stub_wheel(folder, name, version, [])
    return folder


def resolve(wheels: Path, requirement: str, tmp_path: Path) -> dict[str, str]:
    """name -> version of what pip would install for ``requirement`` (index off, ``wheels`` only)."""
    report = tmp_path / "report.json"
    dropped = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_CONSTRAINT")
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    command = [
        sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
        "--find-links", str(wheels), "--report", str(report), "--quiet", requirement,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    installed = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in installed}


def test_the_stand_ins_carry_the_dsl_s_own_requirements() -> None:
    """Where a DSL distribution is installed, its stand-in's requirements are among its own."""
    checked = 0
    for name, requires in DSL_DISTRIBUTIONS.items():
        try:
            real = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if real.version != DSL:
            continue
        pins = {str(Requirement(pin)) for pin in real.requires or []}
        assert {str(Requirement(pin)) for pin in requires} <= pins, (name, sorted(pins))
        checked += 1
    if not checked:
        pytest.skip(f"no distribution of the DSL {DSL} is installed here")


@pytest.mark.parametrize("extras", REQUESTS)
@pytest.mark.parametrize("package", PACKAGES)
def test_each_extra_pairs_the_cuda_libraries_with_their_bindings(
    package: str, extras: str, wheels: Path, tmp_path: Path
) -> None:
    resolved = resolve(wheels, f"{package}[{extras}]", tmp_path)
    majors = {CUDA_LIBS[name] for name in resolved if name in CUDA_LIBS}
    assert majors, resolved  # every request brings one runtime at least
    bindings = resolved.get("cuda-bindings")
    assert bindings is not None, resolved
    # The compiler ([jit]) is CUDA 12's whatever runtime stands beside it: its bindings are then 12's.
    expected = 12 if 12 in majors else 13
    assert int(bindings.split(".")[0]) == expected, (package, extras, resolved)
