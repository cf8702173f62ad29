"""The on-disk kernel cache and the shipped manifests against what eight ranks and a shared machine
do to them (issue #31): concurrent ranks, truncated libraries, broken sidecars and manifests,
files and folders someone else owns or can write, planted links. Real processes and real files;
the DSL's compile and export are a stand-in that builds a real small library
(``tests.core.cache_support``), so everything from the lock to ``dlopen`` runs as on a GPU host.
Loads that may crash (a truncated library: SIGBUS before the fix) run in a child process."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.core import cache_support
from tests.core.cache_support import (
    ARCH,
    OTHER_UID,
    ROOT,
    child_env,
    report,
    run_child,
    run_together,
    start_together,
    warnings_of,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="the cache links with a C compiler (cc)")


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> Any:
    """What a new process starts with: no kernel in memory, no warning given, manifests unread."""
    from mhc_core.host.binaries import artifacts, compiler

    monkeypatch.setattr(compiler, "_CACHE", {})
    try:
        from mhc_core.host.binaries import cache_files
    except ImportError:  # the parent commit has no such module
        pass
    else:
        monkeypatch.setattr(cache_files, "_warned", set())
    monkeypatch.setattr(artifacts, "_SKIPPED", {}, raising=False)
    try:
        from mhc_core.host.binaries import verified
    except ImportError:  # the parent commit has no such module
        pass
    else:
        monkeypatch.setattr(verified, "_CHECKED", {})
    cache_support.COMPILES.clear()
    _clear_manifest_caches()
    yield
    _clear_manifest_caches()


def _clear_manifest_caches() -> None:
    from mhc_core.host.binaries import artifacts

    for name in ("_manifests", "_index", "_recorded_sources", "source_hash", "_shipped_problem"):
        function = getattr(artifacts, name, None)
        if hasattr(function, "cache_clear"):
            function.cache_clear()


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the stand-in kernel, as the first process to build it leaves it."""
    from mhc_core.host.binaries import compiler

    root = tmp_path_factory.mktemp("template") / "cache"
    with pytest.MonkeyPatch.context() as patch:
        cache_support.install_fakes(patch)
        patch.setattr(compiler, "_CACHE", {})
        patch.setenv("MHC_CACHE_DIR", str(root))
        compiler.compile_kernel(cache_support.spec(), ARCH, persist=True)
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache this test's process (and its children) use."""
    root = tmp_path / "cache"
    monkeypatch.setenv("MHC_CACHE_DIR", str(root))
    return root


@pytest.fixture
def populated(cache: Path, template: Path) -> Path:
    shutil.copytree(template, cache, symlinks=True)
    return cache


def entry(cache: Path) -> tuple[Path, Path]:
    """The stand-in kernel's library and sidecar in ``cache``."""
    library = cache / "kernels" / ARCH / f"{cache_support.key().symbol}.so"
    return library, library.with_suffix(".json")


def build_here(monkeypatch: pytest.MonkeyPatch) -> Any:
    """An op's construction of the stand-in kernel in this process."""
    from mhc_core.host.binaries import compiler

    cache_support.install_fakes(monkeypatch)
    return compiler.compile_kernel(cache_support.spec(), ARCH, persist=True)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def plant(library: Path, sidecar: Path | None = None) -> None:
    """A library whose constructor creates ``$MHC_TEST_MARKER`` at ``library``; ``sidecar`` records
    its size and sha256 (anyone can compute them) where the format has them."""
    cache_support.stub_library(library, cache_support.key().symbol, plant=True)
    if sidecar is not None:
        recorded = json.loads(sidecar.read_text())
        data = library.read_bytes()
        if "sha256" in recorded:
            import hashlib

            recorded |= {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        sidecar.write_text(json.dumps(recorded))


@pytest.fixture
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Created by a planted library's constructor: it ran in this process."""
    path = tmp_path / "planted-code-ran"
    monkeypatch.setenv(cache_support.MARKER_ENV, str(path))
    return path


# ------------------------------------------------------------------ concurrent ranks
def test_eight_processes_compile_a_kernel_once(tmp_path: Path) -> None:
    """Eight ranks building the same op into one empty cache, all at once: one compiles and
    persists, the seven others wait for its lock, then load its library; no warning."""
    cache, ready, go = tmp_path / "cache", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    command = [sys.executable, "-m", "tests.core.cache_support", "build", "--ready", str(ready), "--go", str(go)]
    outputs = run_together(command, child_env(cache, {cache_support.COMPILE_SECONDS_ENV: "0.3"}), ready, go)
    reports = [report(stdout) for stdout in outputs]
    assert sum(result["compiles"] for result in reports) == 1, reports
    assert sorted(result["loaded"] for result in reports) == [False] + [True] * 7, reports


def test_concurrent_writers_and_a_reader_never_see_a_partial_file(tmp_path: Path, template: Path) -> None:
    """Eight writers persisting the same kernel in a loop (export and link stubbed) while a reader
    looks it up: no writer fails (each writes under its own temporary name), the reader never sees
    a partial sidecar or library."""
    cache, ready, go, stop = tmp_path / "cache", tmp_path / "ready", tmp_path / "go", tmp_path / "stop"
    ready.mkdir()
    library, _ = entry(template)

    def start(*args: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "tests.core.cache_support", *args, "--ready", str(ready), "--go", str(go)]
        pipe = subprocess.PIPE
        return subprocess.Popen(command, cwd=ROOT, env=child_env(cache), stdout=pipe, stderr=pipe, text=True)

    writers = [start("persist", "--template", str(library), "--rounds", "25") for _ in range(8)]
    reader = start("read", "--stop", str(stop))
    try:
        start_together([*writers, reader], ready, go)
        written = [writer.communicate(timeout=120) for writer in writers]
        stop.touch()
        read = reader.communicate(timeout=60)
    finally:
        for process in (*writers, reader):
            process.kill()
    for writer, (stdout, stderr) in zip(writers, written, strict=True):
        assert writer.returncode == 0, stderr[-3000:]
        assert not warnings_of(stderr), warnings_of(stderr)[:3]
        assert report(stdout) == {"written": 25}
    assert reader.returncode == 0, read[1][-3000:]
    assert report(read[0])["errors"] == 0, read[1][-2000:]
    assert not warnings_of(read[1]), warnings_of(read[1])[:3]


# ------------------------------------------------------------------ truncated libraries
@pytest.mark.parametrize("percent", [5, 50])
def test_a_truncated_library_is_skipped_and_recompiled(
    percent: int, populated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library cut short (a crash or a full disk during a write) is never handed to ``dlopen``
    (which maps it: SIGBUS): one warning names it, the kernel is compiled and the entry rewritten;
    the next process loads it."""
    library, _ = entry(populated)
    data = library.read_bytes()
    library.write_bytes(data[: len(data) * percent // 100])
    done = run_child("build", populated)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    found = warnings_of(done.stderr)
    assert len(found) == 1 and f"could not use the kernel cache {library}: " in found[0], found
    assert report(done.stdout) == {"compiles": 1, "loaded": False}
    again = build_here(monkeypatch)  # a later process: the rewritten entry loads
    assert again.kernel is None and not cache_support.COMPILES


def test_without_the_compiler_a_truncated_library_is_named(populated: Path) -> None:
    """On a host without the DSL compiler, a truncated cached library is a clear error naming it."""
    library, _ = entry(populated)
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])
    done = run_child("build", populated, "--no-compiler")
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    error = report(done.stdout)["error"]
    assert str(library) in error and "mhc-core[jit]" in error, error


# ------------------------------------------------------------------ sidecars
def _truncate(text: str) -> str:
    return text[: len(text) // 2]


def _without(field: str) -> Any:
    def edit(text: str) -> str:
        payload = json.loads(text)
        del payload[field]
        return json.dumps(payload)

    return edit


SIDECAR_DAMAGE = {
    "truncated": _truncate,
    "not JSON": lambda text: "\x00\x01 not json",
    "no signature": _without("signature"),
    "no symbol": _without("symbol"),
    "a list": lambda text: "[1, 2]",
    "another kernel's": lambda text: text.replace(json.loads(text)["symbol"], "mhc_000000000000000000000000"),
}


@pytest.mark.parametrize("damage", list(SIDECAR_DAMAGE))
def test_a_broken_sidecar_is_skipped_and_recompiled(
    damage: str, populated: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar truncated, corrupt, without its signature or naming another kernel: one warning
    naming it, the kernel compiled and the entry rewritten, which the next process loads."""
    from mhc_core.host.binaries import compiler

    _, sidecar = entry(populated)
    sidecar.write_text(SIDECAR_DAMAGE[damage](sidecar.read_text()))
    with caplog.at_level(logging.WARNING, logger="mhc"):
        built = build_here(monkeypatch)
        assert built.kernel is not None and len(cache_support.COMPILES) == 1
        found = warnings(caplog)
        assert len(found) == 1 and f"could not use the kernel cache {sidecar}: " in found[0], found
        monkeypatch.setattr(compiler, "_CACHE", {})  # a later process
        again = build_here(monkeypatch)
    assert again.kernel is None and len(cache_support.COMPILES) == 1
    assert len(warnings(caplog)) == 1


def test_a_broken_sidecar_does_not_outlive_the_process(populated: Path) -> None:
    """Two real processes after a sidecar lost its signature: the first warns and recompiles, the
    second loads without a word."""
    _, sidecar = entry(populated)
    sidecar.write_text(_without("signature")(sidecar.read_text()))
    first = run_child("build", populated)
    assert first.returncode == 0, first.stderr[-3000:]
    assert report(first.stdout) == {"compiles": 1, "loaded": False}
    assert len(warnings_of(first.stderr)) == 1 and str(sidecar) in warnings_of(first.stderr)[0]
    second = run_child("build", populated)
    assert second.returncode == 0, second.stderr[-3000:]
    assert report(second.stdout) == {"compiles": 0, "loaded": True}
    assert not warnings_of(second.stderr)


# ------------------------------------------------------------------ owners, modes, links
@pytest.mark.parametrize("folder", ["cache", "kernels", ARCH])
def test_a_cache_folder_others_can_write_is_not_used(
    folder: str,
    populated: Path,
    marker: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """MHC_CACHE_DIR on shared storage: a folder of the cache others can write may hold anything
    (the library's name is computable). One warning names it and says why; nothing in it is loaded
    or written; the kernel is compiled in this process."""
    library, sidecar = entry(populated)
    plant(library, sidecar)
    planted = library.read_bytes()
    shared = {"cache": populated, "kernels": populated / "kernels", ARCH: library.parent}[folder]
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="mhc"):
        built = build_here(monkeypatch)
    assert not marker.exists(), "the planted library was loaded"
    assert built.kernel is not None and len(cache_support.COMPILES) == 1
    found = warnings(caplog)
    assert len(found) == 1 and f"could not use the kernel cache {shared}: " in found[0], found
    assert "writable by its group or others" in found[0]
    assert library.read_bytes() == planted, "the untrusted cache was written"


@pytest.mark.parametrize("which", ["library", "sidecar"])
def test_a_cache_file_another_user_owns_is_not_used(
    which: str,
    populated: Path,
    marker: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A library or sidecar owned by another uid (planted): not loaded; one warning names it and the
    owner; the entry is compiled and rewritten as this user's."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    library, sidecar = entry(populated)
    plant(library, sidecar)
    foreign = library if which == "library" else sidecar
    os.chown(foreign, OTHER_UID, OTHER_UID)
    with caplog.at_level(logging.WARNING, logger="mhc"):
        built = build_here(monkeypatch)
    assert not marker.exists(), "the planted library was loaded"
    assert built.kernel is not None and len(cache_support.COMPILES) == 1
    found = warnings(caplog)
    assert len(found) == 1 and f"could not use the kernel cache {foreign}: " in found[0], found
    assert f"owned by uid {OTHER_UID}" in found[0]
    assert foreign.lstat().st_uid == os.geteuid(), "the entry was not rewritten"


@pytest.mark.parametrize("which", ["library", "sidecar"])
def test_a_symbolic_link_in_the_cache_is_not_followed(
    which: str,
    populated: Path,
    tmp_path: Path,
    marker: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A link planted at ``<symbol>.so`` or ``<symbol>.json``: not followed (one warning says so),
    the entry compiled and rewritten as a plain file; the link's target is left alone."""
    library, sidecar = entry(populated)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    plant(library, sidecar)
    linked = library if which == "library" else sidecar
    target = elsewhere / linked.name
    linked.rename(target)
    linked.symlink_to(target)
    before = target.read_bytes()
    with caplog.at_level(logging.WARNING, logger="mhc"):
        built = build_here(monkeypatch)
    assert not marker.exists(), "the planted library was loaded"
    assert built.kernel is not None and len(cache_support.COMPILES) == 1
    found = warnings(caplog)
    assert len(found) == 1 and f"could not use the kernel cache {linked}: " in found[0], found
    assert "symbolic link" in found[0]
    assert not linked.is_symlink() and target.read_bytes() == before


def test_a_link_at_a_temporary_name_is_not_written_through(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A link planted at a temporary name a write could use (``<symbol>.json.partial``): the sidecar
    is written under a name of its own, the linked file is untouched."""
    folder = cache / "kernels" / ARCH
    folder.mkdir(parents=True, mode=0o700)
    for path in (cache, cache / "kernels"):
        path.chmod(0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    _, sidecar = entry(cache)
    Path(f"{sidecar}.partial").symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="mhc"):
        build_here(monkeypatch)
    assert victim.read_text() == "precious"
    assert sidecar.is_file() and not sidecar.is_symlink()
    assert not warnings(caplog)


def test_the_cache_is_created_private(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every folder of the cache is made 0700 and every file is this user's alone."""
    build_here(monkeypatch)
    library, _ = entry(cache)
    for folder in (cache, cache / "kernels", library.parent):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    for path in library.parent.iterdir():
        assert path.stat().st_mode & 0o077 == 0, path


# ------------------------------------------------------------------ manifests
def _model_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path, Path]:
    """Two model packages, each with a manifest: ``mhcfake_a``'s names the stand-in kernel (its
    library beside it), ``mhcfake_b``'s another. The key, and both manifests' paths."""
    from mhc_core.device.configs import PUBLISH_KERNEL, PublishConfig
    from mhc_core.device.kernel import KernelSpec
    from mhc_core.host.binaries import artifacts

    paths = []
    for package, hidden in (("mhcfake_a", 1040), ("mhcfake_b", 2080)):
        folder = tmp_path / "site" / package / "kernels" / ARCH
        folder.mkdir(parents=True)
        (folder.parents[1] / "__init__.py").write_text("")
        library = f"lib{package}_{ARCH}.so"
        cache_support.stub_library(folder / library, "unused")
        kernel_key = artifacts.kernel_key(
            KernelSpec(PUBLISH_KERNEL, PublishConfig(hidden=hidden, tp=2)), ARCH, "tvm-ffi"
        )
        paths.append(artifacts.write_manifest(folder, package, ARCH, library, [(kernel_key, ())]))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(artifacts, "model_packages", lambda: ("mhcfake_a", "mhcfake_b"))
    _clear_manifest_caches()
    return cache_support.key(), paths[0], paths[1]


def _with_sources(text: str, sources: Any) -> str:
    payload = json.loads(text)
    payload["sources"] = sources
    return json.dumps(payload)


MANIFEST_DAMAGE = {
    "truncated": _truncate,
    "a list": lambda text: "[]",
    "kernels not a list": lambda text: json.dumps(json.loads(text) | {"kernels": "all of them"}),
    "an entry without its signature": lambda text: text.replace('"signature"', '"signatur"'),
    "malformed sources": lambda text: _with_sources(text, {"mhc_core.device.publish": {"digest": 1}}),
}


@pytest.mark.parametrize("damage", list(MANIFEST_DAMAGE))
def test_a_broken_manifest_breaks_no_other_package(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One package's manifest corrupted: the other package's kernels are still found, keys still
    computed (source hashes read every manifest), with MHC_PREBUILT=0 too; one warning names it."""
    from mhc_core.host.binaries import artifacts, compiler

    key, good, broken = _model_packages(tmp_path, monkeypatch)
    broken.write_text(MANIFEST_DAMAGE[damage](broken.read_text()))
    _clear_manifest_caches()  # a process started now
    with caplog.at_level(logging.WARNING, logger="mhc"):
        assert artifacts.kernel_key(cache_support.spec(), ARCH, "tvm-ffi") == key
        found = artifacts.lookup(key)
        assert found is not None and found.library.parent == good.parent
        monkeypatch.setenv(artifacts.PREBUILT_ENV, "0")
        monkeypatch.setattr(compiler, "_compile", cache_support.fake_compile)
        assert compiler.compile_kernel(cache_support.spec(), ARCH, persist=True).kernel is not None
    found_warnings = warnings(caplog)
    assert len(found_warnings) == 1 and f"could not use the manifest {broken}: " in found_warnings[0], found_warnings


def test_a_shipped_library_that_is_not_the_one_recorded_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A shipped library truncated after its manifest was written: not handed to ``dlopen``; one
    warning names it (the kernel is then compiled, or, without the compiler, an error names it)."""
    from mhc_core.host.binaries import artifacts

    key, good, _ = _model_packages(tmp_path, monkeypatch)
    library = good.parent / json.loads(good.read_text())["library"]
    library.write_bytes(library.read_bytes()[:4096])
    _clear_manifest_caches()
    with caplog.at_level(logging.WARNING, logger="mhc"):
        assert artifacts.lookup(key) is None
        assert artifacts.lookup(key) is None
    found = warnings(caplog)
    assert len(found) == 1 and f"could not use the shipped kernels {library}: " in found[0], found
