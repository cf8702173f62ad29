"""The kernel cache, the shipped manifests and the host library against what a shared machine, a
crash and a careless install do to them (issue #52): a library swapped between its hash and its
``dlopen``, folders above the cache others can swap, ancestors made under a permissive umask, a
lock holder that is stopped or hangs, an installed host library truncated or replaced, manifests
without sizes or of another format, scratch folders of killed processes, folders planted where a
file belongs. Real processes and real files; the DSL's compile and export, and the host library's
build where a test does not need a real one, are stand-ins (``tests.core.cache_support``). Loads
that may crash (SIGBUS before the fix) run in a child process."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.core import cache_support
from tests.core import test_kernel_cache_cpu as kernel_cache
from tests.core.cache_support import ARCH, OTHER_UID, ROOT, child_env, report, run_child, warnings_of
from tests.core.test_kernel_cache_cpu import _model_packages, entry, plant, warnings

# The kernel cache tests' fixtures: a fresh process's state, the populated cache, the planted marker.
fresh_process_state = kernel_cache.fresh_process_state
template = kernel_cache.template
populated = kernel_cache.populated
marker = kernel_cache.marker

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="the cache links with a C compiler (cc)")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MHC_CACHE_DIR", str(root))
    return root


def start_child(mode: str, cache: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.core.cache_support", mode, *args]
    pipe = subprocess.PIPE
    return subprocess.Popen(command, cwd=ROOT, env=child_env(cache, env), stdout=pipe, stderr=pipe, text=True)


def wait_for(condition: Any, what: str, process: subprocess.Popen | None = None, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"the child exited ({process.returncode}) before {what}: {process.stderr.read()[-3000:]}"
            )
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def finish(process: subprocess.Popen, seconds: float = 60) -> tuple[str, str]:
    try:
        return process.communicate(timeout=seconds)
    finally:
        process.kill()


# ------------------------------------------------------------------ row 1: the hashed file is the loaded file
def test_a_cached_kernel_swapped_after_its_hash_is_not_loaded(populated: Path, tmp_path: Path, marker: Path) -> None:
    """The cached library is replaced by another (same symbol, a constructor) right after the loading
    process read its sha256 and before it loaded it: what is loaded is what was hashed (the
    descriptor), so the replacement's constructor never runs."""
    library, _ = entry(populated)
    (tmp_path / "planted").mkdir()
    planted = cache_support.stub_library(tmp_path / "planted" / "lib.so", cache_support.key().symbol, plant=True)
    signals = tmp_path / "signals"
    signals.mkdir()
    child = start_child("build", populated, "--swap-signals", str(signals))
    wait_for((signals / "hashed").exists, "the child hashed the library", child)
    os.replace(planted, library)
    (signals / "swapped").touch()
    stdout, stderr = finish(child)
    assert not marker.exists(), "the library swapped in after the hash was loaded"
    assert child.returncode == 0, stderr[-3000:]
    assert report(stdout) == {"compiles": 0, "loaded": True}


def test_a_cached_host_library_swapped_after_its_hash_is_not_loaded(
    cache: Path, tmp_path: Path, marker: Path, host_library: Path
) -> None:
    """The same swap against the host library's cache entry: the one that was hashed is loaded."""
    library = cached_host_entry(cache, host_library)
    (tmp_path / "planted").mkdir()
    planted = cache_support.stub_library(tmp_path / "planted" / "lib.so", "planted", plant=True)
    signals = tmp_path / "signals"
    signals.mkdir()
    child = start_child("host", cache, "--swap-signals", str(signals), "--check-digest")
    wait_for((signals / "hashed").exists, "the child hashed the library", child)
    os.replace(planted, library)
    (signals / "swapped").touch()
    stdout, stderr = finish(child)
    assert not marker.exists(), "the library swapped in after the hash was loaded"
    assert child.returncode == 0, stderr[-3000:]
    assert report(stdout) == {"builds": 0, "current": True}


# ------------------------------------------------------------------ rows 2 and 3: the folders above the cache
@pytest.mark.parametrize("case", ["others can write it", "another user owns it"])
def test_a_cache_under_a_folder_others_control_is_not_used(
    case: str, tmp_path: Path, template: Path, marker: Path
) -> None:
    """MHC_CACHE_DIR=<shared>/cache where <shared> is writable by others without the sticky bit, or
    owned by another user: whoever controls <shared> can swap the whole cache (a planted library
    with a matching sidecar). One warning names <shared> and why; nothing in the cache is loaded
    or written; the kernel is compiled in the process. With the sticky bit the cache is used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    cache = shared / "cache"
    shutil.copytree(template, cache, symlinks=True)
    library, sidecar = entry(cache)
    plant(library, sidecar)
    planted = library.read_bytes()
    if case == "others can write it":
        shared.chmod(0o777)
        reason = "writable by others without the sticky bit"
    else:
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(shared, OTHER_UID, OTHER_UID)
        reason = f"owned by uid {OTHER_UID}"
    done = run_child("build", cache)
    assert not marker.exists(), "a library in a cache others can swap was loaded"
    assert done.returncode == 0, done.stderr[-3000:]
    assert report(done.stdout) == {"compiles": 1, "loaded": False}
    found = warnings_of(done.stderr)
    assert len(found) == 1 and f"could not use the kernel cache {shared}: " in found[0] and reason in found[0], found
    assert library.read_bytes() == planted, "the untrusted cache was written"
    if case == "others can write it":
        shared.chmod(0o1777)  # /tmp's mode: others cannot rename what they do not own
        again = run_child("build", cache)
        assert again.returncode == 0 and not warnings_of(again.stderr), again.stderr[-3000:]
        assert marker.exists(), "a cache under a sticky folder was not used"


@pytest.mark.parametrize("umask", [0o000, 0o002])
def test_missing_folders_above_the_cache_are_created_private(umask: int, tmp_path: Path) -> None:
    """MHC_CACHE_DIR=<base>/a/b/cache with a and b missing, in a process whose umask is 000 or 002:
    every folder it creates is 0700 (they were 0777 and 0775)."""
    cache = tmp_path / "a" / "b" / "cache"
    command = [sys.executable, "-m", "tests.core.cache_support", "build"]
    done = subprocess.run(
        command, cwd=ROOT, env=child_env(cache), capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: os.umask(umask),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for folder in (tmp_path / "a", tmp_path / "a" / "b", cache, cache / "kernels", cache / "kernels" / ARCH):
        assert folder.stat().st_mode & 0o777 == 0o700, f"{folder}: {folder.stat().st_mode & 0o777:o}"


# ------------------------------------------------------------------ row 4: a stuck lock holder
def _held(lock: Path) -> bool:
    """Whether another process holds ``lock`` (flock)."""
    if not lock.exists():
        return False
    with open(lock, "rb") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
        return False


@pytest.mark.parametrize("what", ["kernel", "host library"])
@pytest.mark.parametrize("how", ["hung", "stopped"])
def test_a_stuck_lock_holder_is_named_and_outwaited(how: str, what: str, tmp_path: Path) -> None:
    """A process takes a cache entry's lock, then hangs in its compile (or is stopped with SIGSTOP).
    Another rank that needs the entry says once whom it waits for (the holder's pid), gives up after
    MHC_CACHE_LOCK_TIMEOUT_S, and builds for itself without persisting (it hung, silent, before)."""
    cache = tmp_path / "cache"
    (tmp_path / "stub").mkdir()
    stub = cache_support.stub_library(tmp_path / "stub" / "libstub.so", "source_digest")
    if what == "kernel":
        mode, args = "build", ()
        lock = cache / "kernels" / ARCH / f"{cache_support.key().symbol}.lock"
        persisted = lock.with_suffix(".so")
        expected = {"compiles": 1, "loaded": False}
    else:
        mode, args = "host", ("--fake-load", "--template", str(stub))
        from mhc_core.host.binaries import native

        lock = cache / "native" / native.cached_path(native.digest()).with_suffix(".lock").name
        persisted = lock.with_suffix(".so")
        expected = {"builds": 1}
    holder = start_child(mode, cache, *args, env={cache_support.COMPILE_SECONDS_ENV: "300"})
    try:
        wait_for(lambda: _held(lock), "the holder took the lock", holder)
        deadline = time.monotonic() + 5  # and recorded its pid (the parent commit records none)
        while not lock.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        if how == "stopped":
            os.kill(holder.pid, signal.SIGSTOP)
        env = {"MHC_CACHE_LOCK_TIMEOUT_S": "2"}
        start = time.monotonic()
        waiter = start_child(mode, cache, *args, env=env)
        try:
            stdout, stderr = waiter.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            waiter.kill()
            raise AssertionError(f"the waiter hung behind the {how} holder") from None
        took = time.monotonic() - start
    finally:
        holder.kill()
        holder.wait()
    assert waiter.returncode == 0, stderr[-3000:]
    assert report(stdout) == expected
    found = warnings_of(stderr)
    assert len(found) == 2, found
    assert f"waiting for the lock {lock}, held by pid {holder.pid} on host " in found[0], found
    assert f"{lock}: pid {holder.pid} on host " in found[1] and "more than 2 s" in found[1], found
    assert took < 30, took
    assert not persisted.exists(), "the waiter persisted without the lock"


# ------------------------------------------------------------------ rows 5 and 6: the installed host library
@pytest.fixture(scope="module")
def host_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real host library, built as a checkout or the wheel build does
    (``python3 -m mhc_core.host.binaries.native TARGET``: its record beside it, where the build writes one)."""
    if shutil.which("c++") is None and not os.environ.get("CXX"):
        pytest.skip("building the host library needs a C++ compiler")
    target = tmp_path_factory.mktemp("installed") / "libmhc_host.so"
    done = subprocess.run(
        [sys.executable, "-m", "mhc_core.host.binaries.native", str(target)], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return target


def cached_host_entry(cache: Path, library: Path) -> Path:
    """``library`` where the host library's cache keeps it, with a sidecar of its size and sha256."""
    from mhc_core.host.binaries import native

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MHC_CACHE_DIR", str(cache))
        target = native.cached_path(native.digest())
    target.parent.mkdir(parents=True)
    for path in (cache, target.parent):
        path.chmod(0o700)
    shutil.copyfile(library, target)
    data = target.read_bytes()
    record = {"source_digest": native.digest(), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    target.with_suffix(".json").write_text(json.dumps(record))
    return target


def installed_copy(host_library: Path, folder: Path) -> Path:
    """The installed library and its record (where the build wrote one) copied into ``folder``."""
    folder.mkdir()
    for source in (host_library, host_library.with_suffix(".json")):
        if source.exists():
            shutil.copyfile(source, folder / source.name)
    return folder / host_library.name


def load_installed(cache: Path, installed: Path, host_library: Path) -> subprocess.CompletedProcess:
    """A process that loads the host library with ``installed`` as the one beside ``executor.cc``;
    a build copies the real library into the cache."""
    args = ("--packaged", str(installed), "--template", str(host_library), "--check-digest")
    return run_child("host", cache, *args)


@pytest.mark.parametrize("damage", ["truncated", "a foreign library", "a foreign library and its record", "no record"])
def test_an_installed_host_library_that_is_not_the_one_built_is_skipped(
    damage: str, tmp_path: Path, host_library: Path
) -> None:
    """The installed ``libmhc_host.so`` as built loads without a build; cut short (a SIGBUS in
    ``dlopen`` before), replaced by a foreign library (its constructor ran), replaced along with its
    record (loading it fails: one warning, not an AttributeError), or without the record its build
    writes: one warning names it, then the library is built into the cache and loaded."""
    cache = tmp_path / "cache"
    installed = installed_copy(host_library, tmp_path / "native")
    intact = load_installed(cache, installed, host_library)
    assert intact.returncode == 0, intact.stderr[-3000:]
    assert report(intact.stdout) == {"builds": 0, "current": True} and not warnings_of(intact.stderr)
    ran = tmp_path / "planted-code-ran"
    record = installed.with_suffix(".json")
    if damage == "truncated":
        data = installed.read_bytes()
        installed.write_bytes(data[: len(data) // 2])
        reason = "truncated or replaced"
    elif damage == "no record":
        record.unlink(missing_ok=True)
        reason = "no record of its size and sha256"
    else:
        cache_support.stub_library(installed, "planted", plant=True)
        reason = "truncated or replaced"
        if damage == "a foreign library and its record":
            data = installed.read_bytes()
            if record.exists():
                recorded = json.loads(record.read_text())
                recorded |= {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                record.write_text(json.dumps(recorded))
            reason = "it failed to load"
    done = run_child("host", cache, "--packaged", str(installed), "--template", str(host_library), "--check-digest",
                     env={cache_support.MARKER_ENV: str(ran)})  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"
    if damage != "a foreign library and its record":  # a library its own record vouches for is trusted as installed
        assert not ran.exists(), "the foreign library's constructor ran"
    found = warnings_of(done.stderr)
    assert len(found) == 1 and f"could not use the installed host library {installed}: " in found[0], found
    assert reason in found[0], found
    assert report(done.stdout) == {"builds": 1, "current": True}


# ------------------------------------------------------------------ row 7: manifests
LOAD_SHIPPED = """
import sys
sys.path.insert(0, sys.argv[1])
sys.modules["cutlass"] = None  # a host without the DSL compiler: only a shipped kernel can serve
from mhc_core.host.binaries import artifacts, compiler
from tests.core import cache_support
artifacts.model_packages = lambda: ("mhcfake_a", "mhcfake_b")
try:
    compiler.compile_kernel(cache_support.spec(), cache_support.ARCH)
except RuntimeError as error:
    print("error:", error)
else:
    print("loaded")
"""


def test_a_shipped_library_whose_manifest_records_no_size_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: Path
) -> None:
    """A manifest edited to drop the library's ``size`` and ``sha256``, its library replaced: the
    library is not loaded (it was "trusted as installed"): the kernel is compiled, or, without the
    compiler, an error names the library and why."""
    key, good, _ = _model_packages(tmp_path, monkeypatch)
    payload = json.loads(good.read_text())
    library = good.parent / payload["library"]
    cache_support.stub_library(library, key.symbol, plant=True)
    del payload["size"], payload["sha256"]
    good.write_text(json.dumps(payload))
    done = subprocess.run(
        [sys.executable, "-c", LOAD_SHIPPED, str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env=child_env(tmp_path / "cache", {"PYTHONPATH": f"{os.environ.get('PYTHONPATH', '')}:{ROOT}"}),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists(), "a library its manifest records no sha256 of was loaded"
    assert done.stdout.startswith("error:"), done.stdout
    assert f"{library} (its manifest records no size and sha256 of it" in done.stdout, done.stdout


def test_a_manifest_of_an_unknown_format_is_refused_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest of a format this mhc-core does not read (a newer exporter's, or an edited one):
    none of its kernels is used, one warning names it and its format (it was skipped silently);
    the other package's manifest still counts."""
    from mhc_core.host.binaries import artifacts

    key, good, other = _model_packages(tmp_path, monkeypatch)
    for path in (good, other):
        payload = json.loads(path.read_text())
        if path == good:
            payload["format"] = 99
        path.write_text(json.dumps(payload))
    kernel_cache._clear_manifest_caches()  # a process started now
    with caplog.at_level(logging.WARNING, logger="mhc"):
        assert artifacts.lookup(key) is None
        assert artifacts.lookup(key) is None
    found = warnings(caplog)
    assert len(found) == 1 and f"could not use the manifest {good}: it has format 99" in found[0], found
    assert len(artifacts._index()) == 1  # the other package's kernel


# ------------------------------------------------------------------ row 15: scratch folders of killed processes
def _scratch(folder: Path) -> list[Path]:
    return sorted(path for path in folder.glob("mhc-cache-*")) if folder.exists() else []


def test_scratch_folders_of_killed_processes_are_removed(tmp_path: Path) -> None:
    """Three processes SIGKILLed while persisting a kernel leave their scratch folders; the next
    process that persists removes them (they stayed forever), and the kernel is then loaded."""
    cache = tmp_path / "cache"
    folder = cache / "kernels" / ARCH
    made: set[Path] = set()
    for _ in range(3):
        seen = set(_scratch(folder))
        child = start_child("build", cache, env={cache_support.EXPORT_SECONDS_ENV: "300"})
        wait_for(lambda seen=seen: set(_scratch(folder)) - seen, "the child made its scratch folder", child)
        made |= set(_scratch(folder)) - seen
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert len(made) == 3 and set(_scratch(folder)) & made
    done = run_child("build", cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report(done.stdout) == {"compiles": 1, "loaded": False}
    assert _scratch(folder) == [], _scratch(folder)
    again = run_child("build", cache)
    assert report(again.stdout) == {"compiles": 0, "loaded": True}


# ------------------------------------------------------------------ row 16: a folder where a file belongs
@pytest.mark.parametrize("what", ["kernel", "host library"])
def test_a_folder_planted_where_a_library_belongs_is_moved_aside(what: str, tmp_path: Path) -> None:
    """A folder (with a file in it) at ``<symbol>.so``, or at the host library's cached name: the
    next process moves it aside, says so once with both paths, and persists the library there,
    which the process after loads (persisting was off for good; the host library could not load)."""
    cache = tmp_path / "cache"
    (tmp_path / "stub").mkdir()
    stub = cache_support.stub_library(tmp_path / "stub" / "libstub.so", "source_digest")
    if what == "kernel":
        library = cache / "kernels" / ARCH / f"{cache_support.key().symbol}.so"
        args: tuple[str, ...] = ()
        first, second = {"compiles": 1, "loaded": False}, {"compiles": 0, "loaded": True}
    else:
        from mhc_core.host.binaries import native

        library = cache / "native" / native.cached_path(native.digest()).name
        args = ("--fake-load", "--template", str(stub))
        first, second = {"builds": 1}, {"builds": 0}
    library.mkdir(parents=True)
    for folder in library.parents:
        if folder == tmp_path:
            break
        folder.chmod(0o700)
    (library / "inside").write_text("planted")
    done = run_child("build" if what == "kernel" else "host", cache, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert report(done.stdout) == first
    found = warnings_of(done.stderr)
    assert len(found) == 1 and f"moved aside the folder {library} (a file belongs there) to " in found[0], found
    aside = Path(found[0].rpartition(" to ")[2])
    assert (aside / "inside").read_text() == "planted"
    assert library.is_file()
    again = run_child("build" if what == "kernel" else "host", cache, *args)
    assert again.returncode == 0 and not warnings_of(again.stderr), again.stderr[-3000:]
    assert report(again.stdout) == second
