"""Each package builds a wheel that declares its pins, license and extras, ships py.typed (and the
generated presets) and installs with the README's command."""

from __future__ import annotations

import email.parser
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from mhc_core import registry

ROOT = Path(__file__).resolve().parents[2]
DSL = "nvidia-cutlass-dsl==4.8.1"
#: 2.11: the GPU hosts' torch (2.11.0+cu130); below 2.14: 2.13.0, CI's, is the newest run (private symm_mem API).
TORCH = "torch>=2.11,<2.14"
#: The model packages: the registry's (``mhc_kernels.models`` entry points), by distribution name.
MODELS = {model.distribution: model for model in registry.models().values()}
PACKAGES = {
    # distribution: (import name, pins its METADATA must declare). No base pin names a CUDA major
    # (issue #34): the DSL's runtime comes from an extra.
    # apache-tvm-ffi: the launch convention; numpy: only so that torch imports without its warning.
    "mhc-core": ("mhc_core", {TORCH, "apache-tvm-ffi<0.2,>=0.1.15", "numpy"}),
    # Every model package: mhc-core (0.6.0: the startup votes, mailbox_allocation) and torch.
    **{distribution: (model.package, {"mhc-core~=0.6.0", TORCH}) for distribution, model in MODELS.items()},
}
#: mhc-core's extras: the DSL's CUDA 12 libraries (with CUDA 12 bindings) or CUDA 13 ones, and the
#: compiler ([jit]); the model packages' extras name mhc-core's.
CORE_EXTRAS = {
    "cu12": {
        'nvidia-cutlass-dsl-libs-cu12==4.8.1; extra == "cu12"',
        'cuda-bindings<13,>=12.8; extra == "cu12"',
    },
    "cu13": {'nvidia-cutlass-dsl-libs-cu13==4.8.1; extra == "cu13"'},
    "jit": {'nvidia-cutlass-dsl==4.8.1; extra == "jit"', 'cuda-bindings<13,>=12.8; extra == "jit"'},
}
MODEL_EXTRAS = {extra: {f'mhc-core[{extra}]~=0.6.0; extra == "{extra}"'} for extra in CORE_EXTRAS}
EXTRAS = {"mhc-core": CORE_EXTRAS, **dict.fromkeys(MODELS, MODEL_EXTRAS)}
#: Each package's own version (its __init__); bumped when its kernels or API change. A model
#: package not listed here is checked against its __init__ alone.
KNOWN_VERSIONS = {"mhc-core": "0.6.0", "mhc-dsv41": "0.5.2", "mhc-glm5": "0.9.2"}
#: mhc-core ships its host library (libmhc_host.so, built from executor.cc): always platform-tagged.
NATIVE = ("mhc_core/host/binaries/native/libmhc_host.so", "mhc_core/host/binaries/native/libmhc_host.json")
LICENSE = ROOT / "LICENSE"
#: sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (11,358 bytes).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

BUILD = """
import sys
from hatchling.build import build_wheel
print(build_wheel(sys.argv[1]))
"""


def version_of(package: str) -> str:
    """The version in the file the package's pyproject names as its one source ([tool.hatch.version])."""
    folder = ROOT / "packages" / package
    with (folder / "pyproject.toml").open("rb") as stream:
        source = tomllib.load(stream)["tool"]["hatch"]["version"]["path"]
    text = (folder / source).read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    assert match, f"{package}: no __version__"
    return match.group(1)


#: Each package's version: ``KNOWN_VERSIONS``'s, or its __init__'s where it has no entry there.
VERSIONS = {package: KNOWN_VERSIONS.get(package) or version_of(package) for package in PACKAGES}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every package's wheel, built with hatchling's PEP 517 hook (what ``python -m build --wheel`` calls)."""
    pytest.importorskip("hatchling", reason="hatchling builds the wheels (nox -s tests installs it)")
    out = tmp_path_factory.mktemp("wheels")
    built = {}
    for package in PACKAGES:
        result = subprocess.run(
            [sys.executable, "-c", BUILD, str(out)],
            cwd=ROOT / "packages" / package,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, f"{package}: {result.stderr}"
        built[package] = out / result.stdout.strip().splitlines()[-1]
    return built


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(archive.read(name).decode())


def normal(pin: str) -> str:
    """A requirement in one spelling (hatchling sorts the specifiers and quotes markers its own way)."""
    from packaging.requirements import Requirement  # hatchling's dependency, like the wheels themselves

    return str(Requirement(pin))


@pytest.mark.parametrize("package", PACKAGES)
def test_metadata(package: str, wheels: dict[str, Path]) -> None:
    meta = metadata(wheels[package])
    assert meta["Name"] == package
    assert meta["Version"] == version_of(package) == VERSIONS[package]
    assert meta["Requires-Python"] == ">=3.11"
    expected = PACKAGES[package][1].union(*EXTRAS[package].values())
    assert {normal(pin) for pin in meta.get_all("Requires-Dist")} == {normal(pin) for pin in expected}
    assert set(meta.get_all("Provides-Extra")) == set(EXTRAS[package])
    module = PACKAGES[package][0]
    # A model wheel is tagged for the platform once its kernels are exported into the checkout;
    # mhc-core always (its host library).
    shipped = package == "mhc-core" or any((ROOT / "packages" / package / "src" / module / "kernels").glob("*/*.so"))
    tag = "py3-none-linux_x86_64" if shipped else "py3-none-any"
    assert wheels[package].name == f"{module}-{VERSIONS[package]}-{tag}.whl"


@pytest.mark.parametrize("package", PACKAGES)
def test_contents(package: str, wheels: dict[str, Path]) -> None:
    module = PACKAGES[package][0]
    names = set(zipfile.ZipFile(wheels[package]).namelist())
    assert f"{module}/py.typed" in names
    assert f"{module}/__init__.py" in names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]
    source = ROOT / "packages" / package / "src" / module
    shipped = {name for name in names if not name.startswith(f"{module}-{VERSIONS[package]}.dist-info/")}
    expected = {str(path.relative_to(source.parent)) for path in source.rglob("*.py")} | {f"{module}/py.typed"}
    if package == "mhc-core":  # the host library and the sources its digest is checked against
        expected |= {
            *NATIVE,
            "mhc_core/host/binaries/native/executor.cc",
            "mhc_core/host/binaries/native/glibc_floor.cc",
        }
    kernels = {name for name in shipped if "/kernels/" in name}  # exported kernels, where there are
    assert shipped - kernels == expected


@pytest.mark.parametrize("package", MODELS)
def test_presets_are_shipped(package: str, wheels: dict[str, Path]) -> None:
    module = PACKAGES[package][0]
    names = set(zipfile.ZipFile(wheels[package]).namelist())
    generated = sorted((ROOT / "packages" / package / "src" / module / "presets").glob("*.py"))
    assert len(generated) > 1, "no generated presets: run python3 -m codegen"
    for path in generated:
        assert f"{module}/presets/{path.name}" in names


def test_license_text() -> None:
    """The repository's and every package's LICENSE: the Apache License 2.0, unmodified."""
    text = LICENSE.read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text
    assert hashlib.sha256(LICENSE.read_bytes()).hexdigest() == APACHE_2_0_SHA256
    for package in PACKAGES:
        assert (ROOT / "packages" / package / "LICENSE").read_bytes() == LICENSE.read_bytes(), package


@pytest.mark.parametrize("package", PACKAGES)
def test_license(package: str, wheels: dict[str, Path]) -> None:
    """PEP 639: the SPDX expression in METADATA and the LICENSE file in the dist-info."""
    meta = metadata(wheels[package])
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None  # the expression replaces the legacy field
    with zipfile.ZipFile(wheels[package]) as archive:
        shipped = archive.read(f"{PACKAGES[package][0]}-{VERSIONS[package]}.dist-info/licenses/LICENSE")
    assert shipped == LICENSE.read_bytes()


#: The README's install commands ("Install"), run as written from a folder whose dist/ holds the wheels.
INSTALL_ALL = "python3 -m pip install dist/*.whl"
INSTALL_ONE = "python3 -m pip install dist/mhc_core-*.whl dist/mhc_dsv41-*.whl"
IMPORTS = {
    INSTALL_ALL: ["mhc-core", *MODELS],
    INSTALL_ONE: ["mhc-core", "mhc-dsv41"],
}
#: Classes whose first use loads torch (not the DSL compiler): the dependencies resolve in the new venv.
#: A model package's is its op (``Model.op_type``), which its ``__init__`` exports.
CLASSES = {"mhc_core": "LamportAllReduce", **{model.package: model.op_class for model in MODELS.values()}}
CHECK = """
import sys, {modules}
for module in ({modules},):
    assert module.__file__.startswith(sys.argv[1]), module.__file__
{classes}
assert "torch" in sys.modules and "cutlass" not in sys.modules, "the op classes import without the DSL compiler"
print("imported", {versions})
"""


def fresh_venv(path: Path) -> tuple[Path, dict[str, str]]:
    """A new venv, and the environment that puts it first on PATH.

    It reuses the torch and DSL already installed instead of downloading them (several GB on a GPU
    host): ``--system-site-packages`` sees the base interpreter's, and where this test runs inside a
    venv itself (nox's) a .pth file adds that venv's site-packages, through ``site.addsitedir`` so
    that the DSL's own .pth file is read too. ``--without-pip``: a Python 3.11 venv would get its own
    pip and setuptools 65, which hides the installed setuptools and turns torch's
    ``setuptools>=77.0.3`` into a download; ``python3 -m pip`` is then the pip of those site packages,
    installing into the new venv. ``PIP_NO_INDEX``: nothing may come from an index (CI is offline).
    """
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python3"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if sys.prefix != sys.base_prefix:
        parents = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
        lines = "".join(f"import site; site.addsitedir({parent!r})\n" for parent in parents)
        (Path(purelib) / "_mhc_test_parent_env.pth").write_text(lines)
    # No index, and no machine-wide pip settings: their find-links or extra index could serve a wheel.
    dropped = ("PYTHONPATH", "PYTHONHOME", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL")
    env = {key: value for key, value in os.environ.items() if key not in dropped}
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PATH=os.pathsep.join([str(path / "bin"), env.get("PATH", "")]),
        VIRTUAL_ENV=str(path),
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PYTHONNOUSERSITE="1",
    )
    return Path(purelib), env


@pytest.mark.parametrize("command", [INSTALL_ALL, INSTALL_ONE], ids=["all", "one-model"])
def test_readme_install(command: str, wheels: dict[str, Path], tmp_path: Path) -> None:
    """The README's command installs the wheels from dist/ (mhc-core from its wheel, not an index)."""
    assert f"\n{command}\n" in (ROOT / "README.md").read_text(), "the README no longer gives this command"
    if sys.platform == "win32":
        pytest.skip("the venv layout and the shell glob are POSIX")
    for dependency in ("torch", "nvidia-cutlass-dsl", "numpy", "apache-tvm-ffi", "pip"):
        try:
            importlib.metadata.version(dependency)
        except importlib.metadata.PackageNotFoundError:  # e.g. the DSL unpacked onto PYTHONPATH on a GPU host
            pytest.skip(f"{dependency} is not installed as a distribution: pip could not reuse it offline")
    (tmp_path / "dist").mkdir()
    for wheel in wheels.values():
        shutil.copy(wheel, tmp_path / "dist")
    purelib, env = fresh_venv(tmp_path / "venv")
    install = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    packages = IMPORTS[command]
    installed = sorted(path.name for path in purelib.glob("mhc_*.dist-info"))
    assert installed == sorted(f"{PACKAGES[package][0]}-{VERSIONS[package]}.dist-info" for package in packages)
    modules = [PACKAGES[package][0] for package in packages]
    code = CHECK.format(
        modules=", ".join(modules),
        classes="\n".join(f"{module}.{CLASSES[module]}" for module in modules),
        versions=", ".join(f"{module}.__version__" for module in modules),
    )
    python = tmp_path / "venv" / "bin" / "python3"
    check = subprocess.run([python, "-c", code, str(purelib)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["imported", *(VERSIONS[package] for package in packages)]


def test_a_model_wheel_without_the_core_wheel_fails_offline(wheels: dict[str, Path], tmp_path: Path) -> None:
    """With the index disabled (and no machine-wide find-links), pip cannot fetch ``mhc-core`` from
    anywhere: a model wheel given without the core wheel fails, instead of asking an index where
    anyone could register the name. ``--ignore-installed``: the mhc-core this test runs from does not
    count, as it would not in an engine's fresh environment."""
    if sys.platform == "win32":
        pytest.skip("the venv layout is POSIX")
    (tmp_path / "dist").mkdir()
    shutil.copy(wheels["mhc-dsv41"], tmp_path / "dist")
    purelib, env = fresh_venv(tmp_path / "venv")
    commands = {
        "python3 -m pip install --ignore-installed dist/mhc_dsv41-*.whl": "No matching distribution found for",
        "python3 -m pip install --ignore-installed --no-deps 'mhc-core~=0.6.0'": (
            "No matching distribution found for mhc-core~=0.6.0"
        ),
    }
    for command, expected in commands.items():
        install = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert install.returncode != 0, install.stdout
        assert expected in install.stderr, install.stderr
    assert not list(purelib.glob("mhc_*.dist-info"))


def test_build_session_retags_with_auditwheel() -> None:
    """``nox -s build`` tags every platform wheel it writes with the platform floor (``tools.manylinux``,
    checked by auditwheel: ``test_platform_floor_cpu``)."""
    noxfile = (ROOT / "noxfile.py").read_text()
    assert '"-m", "tools.manylinux"' in noxfile
