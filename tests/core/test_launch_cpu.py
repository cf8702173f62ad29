"""The launch path without a GPU: every kernel is built for TVM-FFI with the PTX the DSL's default
convention gives; shipped and cached kernels load instead of compiling."""

from __future__ import annotations

import contextlib
import io
import tempfile

import pytest


def default_convention_ptx(kernel, arch: str) -> str:
    import cutlass.cute as cute

    from mhc_core.device.signature import fake_arguments

    with tempfile.TemporaryDirectory(prefix="mhc-ptx-") as dump, contextlib.redirect_stderr(io.StringIO()):
        options = f"--gpu-arch {arch} --keep-ptx --dump-dir {dump} remarks{{ptx}}"
        return cute.compile(kernel, *fake_arguments(kernel.signature()), options=options).__ptx__


@pytest.mark.parametrize("preset", ["dsv41:h200-tp1-h5120", "dsv41:h200-tp2-h5120"])
def test_tvm_ffi_build_has_the_default_conventions_ptx(preset: str) -> None:
    """The calling convention changes the host wrapper only: the kernel's PTX is the same."""
    import importlib

    from mhc_core.host.binaries.compiler import COMPILE_OPTIONS, compile_kernel

    assert "--enable-tvm-ffi" in COMPILE_OPTIONS
    model, name = preset.split(":")
    module = importlib.import_module(f"mhc_{model}.presets").get(name)
    for kernel in module.kernels("sm_90a").values():
        built = compile_kernel(kernel, "sm_90a", inspect=True)
        assert type(built.compiled).__name__.startswith("TVMFFI"), type(built.compiled)
        assert built.ptx == default_convention_ptx(kernel, "sm_90a"), f"{kernel}: PTX differs"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``dsv41.h200-tp1-h5120``'s kernels exported (sm_90a) the way ``nox -s build`` does: its manifest."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from mhc_core.host.binaries import artifacts

    if shutil.which("cc") is None:
        pytest.skip("linking the kernels needs a C compiler (cc)")
    out = tmp_path_factory.mktemp("exported")
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tools.export_kernels", "--preset", "dsv41.h200-tp1-h5120", "--out", str(out)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / "mhc_dsv41" / "kernels" / "sm_90a" / artifacts.MANIFEST


WITHOUT_THE_DSL = """
import sys
from pathlib import Path
import mhc_core.host.allreduce, mhc_dsv41.op, mhc_glm5.op  # every op module, as an engine imports them
from mhc_core.host.binaries import artifacts, compiler
from mhc_dsv41 import presets
artifacts._index = lambda: artifacts.read_manifest(Path(sys.argv[1]))
for name, (path, config) in presets.get("h200-tp1-h5120").PRESET.kernel_specs("sm_90a").items():
    loaded = compiler.compile_kernel(compiler.KernelSpec(path, config), "sm_90a")
    assert loaded.kernel is None and loaded.function is not None, name
    assert [param.name for param in loaded.signature][-1] == "stream", name
dsl = sorted(module for module in sys.modules if module.split(".")[0] == "cutlass")
assert not dsl, f"the DSL was imported: {dsl[:5]}"
print("loaded without the DSL")
"""


def test_op_modules_and_shipped_kernels_need_no_dsl(exported) -> None:
    """An engine's process: the op modules imported, every kernel of a preset named by spec and
    loaded from a manifest, and no ``cutlass`` module imported (a host with the DSL's runtime
    library alone can build ops: issue #17)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-c", WITHOUT_THE_DSL, str(exported)]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loaded without the DSL" in done.stdout


def test_a_shipped_kernel_loads_instead_of_compiling(exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_kernel`` finds a kernel's full key in a manifest and loads its entry point from the
    library: ``cute.compile`` is never called. A different key (another arch) still compiles."""
    import cutlass.cute as cute

    from mhc_core.host.binaries import artifacts, compiler

    manifest = exported
    monkeypatch.setattr(artifacts, "_index", lambda: artifacts.read_manifest(manifest))
    monkeypatch.setattr(compiler, "_CACHE", {})

    def refuse(*args, **kwargs):
        raise AssertionError("cute.compile was called for a shipped kernel")

    from mhc_dsv41.presets import h200_tp1_h5120

    kernel = h200_tp1_h5120.kernels("sm_90a")["collective"]
    with monkeypatch.context() as patch:
        patch.setattr(cute, "compile", refuse)
        loaded = compiler.compile_kernel(kernel, "sm_90a")
    assert loaded.compiled is None and type(loaded.function).__name__ == "Function"
    monkeypatch.setenv(artifacts.PREBUILT_ENV, "0")
    assert artifacts.lookup(artifacts.kernel_key(kernel, "sm_90a", compiler.CALLING_CONVENTION)) is None


def test_a_manifests_recorded_sources_stand_in_for_the_import_walk(exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest records, per kernel module, the modules its source hash covered and the digest.
    While their texts are as recorded, ``source_hash`` returns it without walking (parsing) the
    imports; a text that changed since falls back to the walk."""
    import json

    from mhc_core.host.binaries import artifacts

    payload = json.loads(exported.read_text())
    walked = {}
    for entry in payload["kernels"]:
        module = entry["kernel"].partition(":")[0]
        walked[module] = artifacts._digest(artifacts.hashed_sources(module))
        assert entry["source"] == walked[module]
        covered = sorted(artifacts.hashed_sources(module))
        recorded = payload["sources"][module]
        assert (recorded["digest"], recorded["modules"], sorted(recorded["texts"])) == (
            walked[module],
            covered,
            covered,
        )

    def refuse(module: str) -> dict[str, bytes]:
        raise AssertionError(f"the imports of {module} were walked")

    def clear() -> None:  # the per-process caches, around this test's own manifest
        artifacts._recorded_sources.cache_clear()
        artifacts.source_hash.cache_clear()

    monkeypatch.setattr(artifacts, "_manifests", lambda: (artifacts.Manifest(payload, {}),))
    clear()
    try:
        with monkeypatch.context() as patch:
            patch.setattr(artifacts, "hashed_sources", refuse)
            assert {module: artifacts.source_hash(module) for module in walked} == walked
        for source in payload["sources"].values():
            source["texts"] = dict.fromkeys(source["texts"], "0" * 64)  # as if every text had changed since
        clear()
        assert {module: artifacts.source_hash(module) for module in walked} == walked
    finally:
        clear()


def test_a_kernel_compiled_here_persists_in_the_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With MHC_CACHE_DIR set, a compiled kernel is exported there under its key, and a later
    ``compile_kernel`` (an empty in-process cache, as in a new process) loads it without compiling."""
    import shutil

    import cutlass.cute as cute

    from mhc_core.host.binaries import artifacts, compiler
    from mhc_dsv41.presets import h200_tp1_h5120

    if shutil.which("cc") is None:
        pytest.skip("linking the kernels needs a C compiler (cc)")
    monkeypatch.setenv("MHC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(artifacts, "_index", lambda: {})  # nothing shipped
    monkeypatch.setattr(compiler, "_CACHE", {})
    kernel = h200_tp1_h5120.kernels("sm_90a")["publish"]
    compiler.compile_kernel(kernel, "sm_90a", persist=True)
    key = artifacts.kernel_key(kernel, "sm_90a", compiler.CALLING_CONVENTION)
    assert (tmp_path / "kernels" / "sm_90a" / f"{key.symbol}.so").exists()
    assert (tmp_path / "kernels" / "sm_90a" / f"{key.symbol}.json").exists(), "its key and signature beside it"
    monkeypatch.setattr(compiler, "_CACHE", {})

    def refuse(*args, **kwargs):
        raise AssertionError("cute.compile was called for a cached kernel")

    monkeypatch.setattr(cute, "compile", refuse)
    loaded = compiler.compile_kernel(kernel, "sm_90a", persist=True)
    assert loaded.compiled is None and type(loaded.function).__name__ == "Function"


def test_a_kernel_no_package_ships_needs_the_compiler_and_says_so(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host with the DSL's runtime alone, a configuration no installed package ships raises a
    clear error naming the [jit] extra, before anything imports the kernel's module (which imports
    the DSL and would fail with a bare ModuleNotFoundError)."""
    import sys

    from mhc_core.device.configs import PUBLISH_KERNEL, PublishConfig
    from mhc_core.device.kernel import KernelSpec
    from mhc_core.host.binaries import artifacts, compiler

    monkeypatch.setenv("MHC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(artifacts, "_index", lambda: {})  # nothing shipped, nothing cached
    monkeypatch.setattr(compiler, "_CACHE", {})
    monkeypatch.setitem(sys.modules, "cutlass", None)  # `import cutlass` raises ImportError
    monkeypatch.setattr(KernelSpec, "instantiate", lambda self: pytest.fail("the kernel's module was imported"))
    spec = KernelSpec(PUBLISH_KERNEL, PublishConfig(hidden=1000, tp=2))
    with pytest.raises(RuntimeError, match=r"no installed package ships this kernel .* pip install 'mhc-core\[jit\]'"):
        compiler.compile_kernel(spec, "sm_90a")


def test_a_kernels_source_hash_covers_device_code_only() -> None:
    """A kernel's key hashes the modules it runs with: its device modules and the package
    ``__init__`` files they pass through, never the host side (a model package's ``__init__`` names
    its op under ``TYPE_CHECKING``). A host change (the compiler, an op) must not make every shipped
    kernel look stale: on the H200 a change to ``host/binaries/compiler.py`` did, for GLM's boundary kernels."""
    import importlib

    from mhc_core import registry
    from mhc_core.host.binaries import artifacts

    models = registry.models().values()
    host = (
        "mhc_core.host",
        *(part for model in models for part in (model.op_module, model.custom_ops, model.presets_package) if part),
    )
    modules = set()
    for model in models:
        presets = importlib.import_module(model.presets_package)
        for name in presets.names():
            for kernels in presets.get(name).KERNELS.values():  # arch -> name -> (class path, config)
                modules.update(path.split(":")[0] for path, _ in kernels.values())
    assert {"mhc_dsv41.kernel", "mhc_glm5.boundary", "mhc_glm5.mixes", "mhc_core.device.publish"} <= modules
    for module in sorted(modules):
        reached = artifacts.hashed_sources(module)
        assert not [name for name in reached if name.startswith(host)], (module, sorted(reached))
