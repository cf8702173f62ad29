"""The host library's cache (``<cache>/native/libmhc_host-<digest>.so``) under the kernel cache's
rules (issue #31): its size and sha256 are recorded when it is built and checked before it is
loaded, a file someone else owns or can write is never loaded, concurrent ranks build it once.
The build is a stand-in (a real small library, ``tests.core.cache_support``); a load that may
crash (a truncated library: SIGBUS before the fix) runs in a child process."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.core import cache_support
from tests.core.cache_support import (
    OTHER_UID,
    BuildCalled,
    child_env,
    report,
    run_child,
    run_together,
    warnings_of,
)

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="the stand-in library is built with cc")


@pytest.fixture(autouse=True)
def no_warning_given(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        from mhc_core.host.binaries import cache_files
    except ImportError:  # the parent commit has no such module
        return
    monkeypatch.setattr(cache_files, "_warned", set())


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MHC_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real library (what the stand-in build copies)."""
    return cache_support.stub_library(tmp_path_factory.mktemp("stub") / "libstub.so", "source_digest")


def target() -> Path:
    from mhc_core.host.binaries import native

    return native.cached_path(native.digest())


def library_now() -> Any:
    """``native.library()`` as a new process calls it (it is cached per process)."""
    from mhc_core.host.binaries import native

    return native.library.__wrapped__()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def cached_entry(cache: Path, library: Path, *, sha256: str | None = None) -> Path:
    """``library`` copied to where the cache keeps the host library, with a sidecar recording its
    size and sha256 (``sha256`` instead, where given); folders as a first build leaves them (0700)."""
    from mhc_core.host.binaries import native

    folder = target().parent
    folder.mkdir(parents=True)
    for path in (cache, folder):
        path.chmod(0o700)
    shutil.copyfile(library, target())
    data = target().read_bytes()
    entry = {"source_digest": native.digest(), "size": len(data), "sha256": sha256 or hashlib.sha256(data).hexdigest()}
    target().with_suffix(".json").write_text(json.dumps(entry))
    return target()


def test_a_built_library_is_recorded_then_loaded_without_a_rebuild(
    cache: Path, stub: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first call builds into the cache (0700) and records the library's size and sha256; the
    next process finds it, checks it and loads it."""
    built = cache_support.fake_native(monkeypatch, template=stub, fake_load=True)
    with caplog.at_level(logging.WARNING, logger="mhc"):
        assert library_now() == f"loaded {target()}"
        assert library_now() == f"loaded {target()}"
    assert built == [target()] and not warnings(caplog)
    assert target().parent.stat().st_mode & 0o777 == 0o700
    recorded = json.loads(target().with_suffix(".json").read_text())
    assert recorded["size"] == stub.stat().st_size
    assert recorded["sha256"] == hashlib.sha256(stub.read_bytes()).hexdigest()


def _planted(tmp_path: Path) -> Path:
    path = tmp_path / "planted.so"
    return cache_support.stub_library(path, "planted", plant=True)  # no source_digest to call


@pytest.mark.parametrize("case", ["another user's", "wrong sha256", "a folder others can write", "corrupt sidecar"])
def test_a_planted_host_library_is_not_loaded(
    case: str, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``libmhc_host-*.so`` planted in the cache (its name is computable) is checked before
    ``dlopen`` runs its constructor: another user's file, one whose sha256 is not the recorded one,
    one in a folder others can write, one whose sidecar is corrupt; one warning says which and why,
    and the library is built instead (into a private temporary folder where the cache is unsafe)."""
    if case == "another user's" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    marker = tmp_path / "planted-code-ran"
    monkeypatch.setenv(cache_support.MARKER_ENV, str(marker))
    library = cached_entry(cache, _planted(tmp_path), sha256="0" * 64 if case == "wrong sha256" else None)
    named, reason = library, "sha256 differs"
    if case == "another user's":
        os.chown(library, OTHER_UID, OTHER_UID)
        reason = f"owned by uid {OTHER_UID}"
    elif case == "a folder others can write":
        library.parent.chmod(0o777)
        named, reason = library.parent, "writable by its group or others"
    elif case == "corrupt sidecar":
        sidecar = library.with_suffix(".json")
        sidecar.write_text(sidecar.read_text()[:20])
        named, reason = sidecar, "corrupt or truncated"
    built = cache_support.fake_native(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="mhc"):
        try:
            outcome: Any = library_now()
        except Exception as error:  # BuildCalled, or what loading the planted library raised
            outcome = error
    assert not marker.exists(), "the planted library was loaded"
    assert isinstance(outcome, BuildCalled), outcome
    found = warnings(caplog)
    assert len(found) == 1 and f"could not use the host library cache {named}: " in found[0], found
    assert reason in found[0], found
    in_cache = built[0].parent == library.parent
    assert in_cache == (case != "a folder others can write"), built


def test_a_truncated_host_library_is_rebuilt(cache: Path, stub: Path) -> None:
    """A host library cut short after its sidecar was written is never mapped (SIGBUS): one warning
    names it, and it is built again."""
    library = cached_entry(cache, stub)
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 2])
    done = run_child("host", cache)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    found = warnings_of(done.stderr)
    assert len(found) == 1 and f"could not use the host library cache {library}: " in found[0], found
    assert report(done.stdout) == {"builds": 1}


def test_eight_processes_build_the_host_library_once(tmp_path: Path, stub: Path) -> None:
    """Eight ranks starting at once on an empty cache: one builds the host library, the others wait
    for its lock and then load what it built (loads stubbed: no tvm_ffi)."""
    cache, ready, go = tmp_path / "cache", tmp_path / "ready", tmp_path / "go"
    ready.mkdir()
    command = [sys.executable, "-m", "tests.core.cache_support", "host", "--fake-load", "--template", str(stub)]
    command += ["--ready", str(ready), "--go", str(go)]
    outputs = run_together(command, child_env(cache, {cache_support.COMPILE_SECONDS_ENV: "0.3"}), ready, go)
    assert sum(report(stdout)["builds"] for stdout in outputs) == 1, outputs
