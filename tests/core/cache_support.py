"""Helpers of the kernel-cache tests (``test_kernel_cache_cpu``, ``test_host_library_cache_cpu``): a
stand-in for the DSL's compile and export that builds a real, small shared library, and the child
processes those tests start (``python -m tests.core.cache_support MODE``).

The stand-in keeps everything between compiling and loading real: ``compile_kernel``'s lock and
second look, ``artifacts.persist`` (export, ``cc`` link, rename, sidecar), ``artifacts.cached``
and ``tvm_ffi.load_module``. Its library exports one TVM-FFI entry point (what ``load`` looks up)
and carries 256 KiB of data, so that a truncated copy keeps its ELF headers and ``dlopen`` maps
segments past the end of the file (a SIGBUS, as with a real kernel library); built with
``-DPLANT`` its constructor creates the file ``$MHC_TEST_MARKER``: it ran.

Nothing here imports torch or the DSL at import time (the writer and reader children stay cheap).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ARCH = "sm_90a"
MARKER_ENV = "MHC_TEST_MARKER"
OTHER_UID = 65534  # nobody
#: Seconds the stand-in compile takes (the 8-process test widens the window every rank misses in).
COMPILE_SECONDS_ENV = "MHC_TEST_COMPILE_SECONDS"
#: Seconds the stand-in export sleeps once its object is written in the scratch folder (a kill
#: there leaves the folder behind).
EXPORT_SECONDS_ENV = "MHC_TEST_EXPORT_SECONDS"

STUB_C = r"""
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((used)) static const unsigned char pad[262144] = {1};
int ENTRY(void* self, const void* args, int32_t count, void* result) { return pad[count & 1023]; }
#ifdef PLANT
__attribute__((constructor)) static void planted(void) {
    const char* marker = getenv("MHC_TEST_MARKER");
    if (marker) close(open(marker, O_CREAT | O_WRONLY, 0600));
}
#endif
"""


def spec() -> Any:
    """The kernel every cache test builds (a publish kernel no package ships)."""
    from mhc_core.device.configs import PUBLISH_KERNEL, PublishConfig
    from mhc_core.device.kernel import KernelSpec

    return KernelSpec(PUBLISH_KERNEL, PublishConfig(hidden=1040, tp=2))


def key() -> Any:
    from mhc_core.host.binaries import artifacts

    return artifacts.kernel_key(spec(), ARCH, "tvm-ffi")


def stub_object(target: Path, symbol: str, *, plant: bool = False) -> Path:
    """An object file exporting ``__tvm_ffi_<symbol>`` (what the DSL's ``export_to_c`` writes)."""
    source = target.with_suffix(".c")
    source.write_text(STUB_C)
    command = ["cc", "-c", "-fPIC", f"-DENTRY=__tvm_ffi_{symbol}", "-o", str(target), str(source)]
    subprocess.run(command + (["-DPLANT"] if plant else []), check=True, capture_output=True)
    return target


def stub_library(target: Path, symbol: str, *, plant: bool = False) -> Path:
    """The stand-in linked into a shared library at ``target``."""
    obj = stub_object(target.with_suffix(".o"), symbol, plant=plant)
    subprocess.run(["cc", "-shared", "-o", str(target), str(obj)], check=True, capture_output=True)
    return target


class FakeCompiled:
    """The DSL's compiled object, as far as ``artifacts.persist`` uses it."""

    def export_to_c(self, path: str, function_name: str, export_only_tvm_ffi_symbols: bool = True) -> None:
        stub_object(Path(path), function_name)
        time.sleep(float(os.environ.get(EXPORT_SECONDS_ENV, "0")))


COMPILES: list[str] = []


def fake_compile(kernel: Any, spec: Any, arch: str, inspect: bool) -> Any:
    """``compiler._compile``'s stand-in: counted, as slow as ``$MHC_TEST_COMPILE_SECONDS``."""
    from mhc_core.host.binaries.compiler import CompiledKernel

    COMPILES.append(str(spec))
    time.sleep(float(os.environ.get(COMPILE_SECONDS_ENV, "0")))
    return CompiledKernel(spec, arch, (), FakeCompiled(), kernel="compiled here")


def install_fakes(patch: Any = None) -> None:
    """The stand-in compile, nothing shipped, and a link that needs neither the DSL's runtime nor its
    link flags (two processes that import the DSL). ``patch``: a pytest ``MonkeyPatch`` (in the
    test's process), else set for good (a child)."""
    from mhc_core.host.binaries import artifacts, compiler

    setattr_ = patch.setattr if patch is not None else setattr
    setattr_(compiler, "_compile", fake_compile)
    setattr_(artifacts, "_index", lambda: {})
    setattr_(artifacts, "link_flags", lambda: ())
    setattr_(artifacts, "load_runtime_globally", lambda: None)


def capture_warnings() -> list[str]:
    """Every warning of the ``mhc`` logger from now on, also written to stderr as ``WARNING <message>``."""
    caught: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())
            print("WARNING", record.getMessage(), file=sys.stderr, flush=True)

    logger = logging.getLogger("mhc")
    logger.addHandler(Handler(logging.WARNING))
    logger.setLevel(logging.INFO)
    return caught


def run_child(mode: str, cache: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m tests.core.cache_support MODE ARGS`` with ``MHC_CACHE_DIR=cache``."""
    return subprocess.run(
        [sys.executable, "-m", "tests.core.cache_support", mode, *args],
        cwd=ROOT,
        env=child_env(cache, env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def child_env(cache: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    return os.environ | {"MHC_CACHE_DIR": str(cache)} | (extra or {})


def start_together(processes: list[subprocess.Popen], ready: Path, go: Path) -> None:
    """Wait until every process has imported everything, then let them all go at once."""
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < len(processes):
        exited = [process for process in processes if process.poll() is not None]
        assert not exited, exited[0].communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the processes never got ready"
        time.sleep(0.02)
    go.touch()


def run_together(command: list[str], env: dict[str, str], ready: Path, go: Path, count: int = 8) -> list[str]:
    """``count`` processes of ``command`` started at once (``start_together``); each must exit 0
    without a warning. Their standard outputs."""
    pipe = subprocess.PIPE
    processes = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True) for _ in range(count)
    ]
    try:
        start_together(processes, ready, go)
        outputs = [process.communicate(timeout=120) for process in processes]
    finally:
        for process in processes:
            process.kill()
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr[-3000:]
        assert not warnings_of(stderr), warnings_of(stderr)
    return [stdout for stdout, _ in outputs]


def warnings_of(stderr: str) -> list[str]:
    return [line.removeprefix("WARNING ") for line in stderr.splitlines() if line.startswith("WARNING ")]


def report(stdout: str) -> dict[str, Any]:
    """The JSON line a child prints last."""
    return json.loads(stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ child processes
def _barrier(ready: Path, go: Path) -> None:
    """Say this process is ready, then wait for the test to start every one at once."""
    (ready / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("the test never said go")
        time.sleep(0.005)


def swap_after_hashing(signals: Path) -> None:
    """An attacker's best moment: right after this process has read a library's sha256 (the first
    ``cache_files.digest_of``), it says ``hashed`` in ``signals`` and waits until the test has
    replaced the file and says ``swapped``."""
    from mhc_core.host.binaries import cache_files

    digest_of = cache_files.digest_of

    def hashed_then_wait(descriptor: int) -> tuple[int, str]:
        result = digest_of(descriptor)
        if not (signals / "hashed").exists():
            (signals / "hashed").touch()
            deadline = time.monotonic() + 60
            while not (signals / "swapped").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never swapped the library")
                time.sleep(0.005)
        return result

    cache_files.digest_of = hashed_then_wait


def build_op_kernel(args: argparse.Namespace) -> dict[str, Any]:
    """What an op's construction does for one kernel: ``compile_kernel(..., persist=True)``."""
    from mhc_core.host.binaries import compiler

    real_compile = compiler._compile
    install_fakes()
    if args.swap_signals:
        swap_after_hashing(Path(args.swap_signals))
    if args.no_compiler:  # the real compile, on a host without the DSL compiler
        compiler._compile = real_compile
        sys.modules["cutlass"] = None  # type: ignore[assignment]
    if args.ready:
        _barrier(Path(args.ready), Path(args.go))
    try:
        built = compiler.compile_kernel(spec(), ARCH, persist=True)
    except RuntimeError as error:
        return {"error": str(error)}
    loaded = built.kernel is None and type(built.function).__name__ == "Function"
    return {"compiles": len(COMPILES), "loaded": loaded}


def persist_repeatedly(args: argparse.Namespace) -> dict[str, Any]:
    """A writer: persist the same kernel ``--rounds`` times (export and link stubbed: copies)."""
    from mhc_core.host.binaries import artifacts

    template = Path(args.template)
    artifacts.load_runtime_globally = lambda: None  # type: ignore[assignment]
    artifacts.link = lambda objects, target: shutil.copyfile(template, target)  # type: ignore[assignment]

    class Copied:
        def export_to_c(self, path: str, **_: Any) -> None:
            Path(path).write_bytes(b"object")

    written = 0
    the_key = key()
    _barrier(Path(args.ready), Path(args.go))
    for _ in range(args.rounds):
        written += artifacts.persist(the_key, Copied(), ()) is not None
    return {"written": written}


def read_repeatedly(args: argparse.Namespace) -> dict[str, Any]:
    """A reader: look the kernel up in the cache until ``--stop`` exists (no load: no dlopen)."""
    from mhc_core.host.binaries import artifacts

    the_key = key()
    found = errors = 0
    _barrier(Path(args.ready), Path(args.go))
    while not Path(args.stop).exists():
        try:
            found += artifacts.cached(the_key) is not None
        except Exception as error:  # counted: what the test asserts never happens
            errors += 1
            print("ERROR", type(error).__name__, error, file=sys.stderr)
    return {"found": found, "errors": errors}


class BuildCalled(Exception):
    """Raised by the stand-in of ``native.build`` where a test wants to see it called, not run."""


def fake_native(patch: Any = None, *, template: Path | None = None, fake_load: bool = False) -> list[Path]:
    """Point ``mhc_core.host.binaries.native`` at no installed library, and replace its build (a copy of
    ``template``, else ``BuildCalled``) and, with ``fake_load``, its load (no tvm_ffi). The targets
    built, as a list that fills up."""
    from mhc_core.host.binaries import native

    setattr_ = patch.setattr if patch is not None else setattr
    built: list[Path] = []

    def build(target: Path) -> Path:
        built.append(target)
        if template is None:
            raise BuildCalled(str(target))
        time.sleep(float(os.environ.get(COMPILE_SECONDS_ENV, "0")))
        target.parent.mkdir(parents=True, exist_ok=True)  # as build() does
        partial = target.with_name(f".{target.name}.{os.getpid()}")  # as build(): all or nothing
        shutil.copyfile(template, partial)
        os.replace(partial, target)
        return target

    setattr_(native, "PACKAGED", Path("/nonexistent/libmhc_host.so"))
    setattr_(native, "build", build)
    if fake_load:
        setattr_(native, "_load", lambda path, *recorded, **_: f"loaded {path}")
    return built


def load_host_library(args: argparse.Namespace) -> dict[str, Any]:
    """A rank loading the host library (``native.library()``)."""
    from mhc_core.host.binaries import native

    built = fake_native(template=Path(args.template) if args.template else None, fake_load=args.fake_load)
    if args.packaged:  # an installed library (and its record) where the test put them
        native.PACKAGED = Path(args.packaged)
    if args.swap_signals:
        swap_after_hashing(Path(args.swap_signals))
    if args.ready:
        _barrier(Path(args.ready), Path(args.go))
    module = None
    with contextlib.suppress(BuildCalled):
        module = native.library()
    if args.check_digest:  # a real library was loaded: it answers with this source's digest
        return {"builds": len(built), "current": module is not None and module["source_digest"]() == native.digest()}
    return {"builds": len(built)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["build", "persist", "read", "host"])
    parser.add_argument("--ready")
    parser.add_argument("--go")
    parser.add_argument("--stop")
    parser.add_argument("--template")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-compiler", action="store_true")
    parser.add_argument("--fake-load", action="store_true")
    parser.add_argument("--packaged")
    parser.add_argument("--swap-signals")
    parser.add_argument("--check-digest", action="store_true")
    args = parser.parse_args()
    capture_warnings()
    if args.mode == "build":
        result = build_op_kernel(args)
    elif args.mode == "host":
        result = load_host_library(args)
    elif args.mode == "persist":
        result = persist_repeatedly(args)
    else:
        result = read_repeatedly(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
