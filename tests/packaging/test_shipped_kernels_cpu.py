"""The model wheels carry their exported kernels (``tools.export_kernels``, what ``nox -s build``
runs): every shipped preset's kernels of every arch (not the test presets'), exported and linked on
this CPU-only machine, packed into platform wheels, installed into a fresh venv and resolved there
from the manifests. On CPU,
"resolved" means: the manifest lookup of the kernel's full key succeeds and its entry point is in
the library's dynamic symbol table; a library also loads (no CUDA is touched) without the DSL
compiler being imported."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.packaging.test_wheels import BUILD, MODELS, PACKAGES, fresh_venv

ROOT = Path(__file__).resolve().parents[2]

#: In the fresh venv the registry finds the models through the installed wheels' entry points alone.
RESOLVE = """
import importlib, subprocess, sys
from mhc_core import registry
from mhc_core.host.binaries import artifacts
from mhc_core.host.binaries.compiler import CALLING_CONVENTION
assert all(str(path).startswith(sys.argv[1]) for path in artifacts.manifests()), artifacts.manifests()
assert sorted(registry.packages()) == sorted(sys.argv[2].split(",")), registry.packages()
resolved = 0
for package in registry.packages():
    presets = importlib.import_module(package + ".presets")
    for name in presets.names():
        module = presets.get(name)
        for arch in module.PRESET.archs:
            for kernel in module.kernels(arch).values():
                key = artifacts.kernel_key(kernel, arch, CALLING_CONVENTION)
                found = artifacts.lookup(key)
                assert found is not None and str(found.library).startswith(sys.argv[1]), (name, arch, kernel)
                assert [param.name for param in found.signature] == [param.name for param in kernel.signature()]
                library = found.library
                symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                                         text=True, check=True).stdout
                assert "__tvm_ffi_" + key.symbol in symbols, (name, arch, kernel, key.symbol)
                resolved += 1
print(resolved)
"""

LOAD = """
import json, sys
from pathlib import Path
from mhc_core.host.binaries import artifacts
manifest = artifacts.manifests()[0]
entry = json.loads(manifest.read_text())["kernels"][0]
key = artifacts.KernelKey(**{field: entry[field] for field in artifacts.KernelKey.__dataclass_fields__})
found = artifacts.lookup(key)
assert found is not None and found.library == manifest.parent / json.loads(manifest.read_text())["library"], found
function = artifacts.load(key, found)
assert type(function).__name__ == "Function", type(function)
assert not any(name.split(".")[0] == "cutlass" for name in sys.modules), "the DSL compiler was imported"
print("loaded")
"""


@pytest.fixture(scope="module")
def shipped_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("hatchling", reason="hatchling builds the wheels (nox -s tests installs it)")
    if shutil.which("cc") is None or shutil.which("nm") is None:
        pytest.skip("linking the kernels needs a C compiler (cc) and nm")
    base = tmp_path_factory.mktemp("shipped")
    export = base / "export"
    done = subprocess.run(
        [sys.executable, "-m", "tools.export_kernels", "--out", str(export)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    out = base / "dist"
    built = {}
    for package, module in PACKAGES.items():
        source = base / "src" / package
        shutil.copytree(ROOT / "packages" / package, source, ignore=shutil.ignore_patterns("kernels", "__pycache__"))
        if package in MODELS:
            shutil.copytree(export / module[0] / "kernels", source / "src" / module[0] / "kernels")
        result = subprocess.run([sys.executable, "-c", BUILD, str(out)], cwd=source, capture_output=True, text=True)
        assert result.returncode == 0, f"{package}: {result.stderr}"
        built[package] = out / result.stdout.strip().splitlines()[-1]
    return built


def test_model_wheels_carry_a_library_and_manifest_per_arch(shipped_wheels: dict[str, Path]) -> None:
    import importlib

    for package, model in MODELS.items():
        module = model.package
        wheel = shipped_wheels[package]
        assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
        presets = importlib.import_module(model.presets_package)
        archs = {arch for name in presets.names() for arch in presets.get(name).PRESET.archs}
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for arch in archs:
                assert f"{module}/kernels/{arch}/lib{module}_{arch}.so" in names, (package, arch)
                manifest = json.loads(archive.read(f"{module}/kernels/{arch}/manifest.json"))
                assert manifest["arch"] == arch and manifest["kernels"], (package, arch)
    # mhc-core ships no kernels, but its host library: platform-tagged too.
    assert shipped_wheels["mhc-core"].name.endswith("-py3-none-linux_x86_64.whl"), shipped_wheels["mhc-core"].name


def test_a_fresh_venv_resolves_every_preset_kernel(shipped_wheels: dict[str, Path], tmp_path: Path) -> None:
    import importlib.metadata

    for dependency in ("torch", "nvidia-cutlass-dsl", "apache-tvm-ffi", "pip"):
        try:
            importlib.metadata.version(dependency)
        except importlib.metadata.PackageNotFoundError:  # unpacked onto PYTHONPATH: pip cannot reuse it
            pytest.skip(f"{dependency} is not installed as a distribution")
    purelib, env = fresh_venv(tmp_path / "venv")
    wheels = [str(path) for path in shipped_wheels.values()]
    install = subprocess.run(["python3", "-m", "pip", "install", *wheels], env=env, capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    python = tmp_path / "venv" / "bin" / "python3"
    packages = ",".join(model.package for model in MODELS.values())
    resolve = subprocess.run([python, "-c", RESOLVE, str(purelib), packages], env=env, capture_output=True, text=True)
    assert resolve.returncode == 0, resolve.stderr[-3000:]
    assert int(resolve.stdout.split()[-1]) > 90, resolve.stdout  # 99 shipped preset kernels (2026-12-03)
    load = subprocess.run([python, "-c", LOAD], env=env, capture_output=True, text=True)
    assert load.returncode == 0 and load.stdout.split()[-1] == "loaded", load.stderr[-3000:]


def test_the_test_presets_are_not_shipped(shipped_wheels: dict[str, Path]) -> None:
    """Test presets (issue #34) are the tests' (``tests.presets``): neither their modules nor their own
    kernels are in the wheels; kernels they share with a shipped preset are."""
    from mhc_core.host.binaries import artifacts
    from mhc_core.host.binaries.compiler import CALLING_CONVENTION
    from tests import presets

    for package, entry in MODELS.items():
        model = entry.key
        with zipfile.ZipFile(shipped_wheels[package]) as archive:
            names = archive.namelist()
            shipped = {
                entry["symbol"]
                for name in names
                if name.endswith("/manifest.json")
                for entry in json.loads(archive.read(name))["kernels"]
            }
        tests_only = [name for name in presets.names(model) if name.startswith("test-")]
        assert tests_only, model
        missing = 0
        for name in tests_only:
            assert not [path for path in names if path.endswith(f"/presets/{name.replace('-', '_')}.py")], name
            preset = presets.get(model, name)
            for arch in preset.PRESET.archs:
                for kernel in preset.kernels(arch).values():
                    missing += artifacts.kernel_key(kernel, arch, CALLING_CONVENTION).symbol not in shipped
        assert missing >= 1, f"{package}: every kernel of its test presets was shipped"
