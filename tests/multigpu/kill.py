"""One rank of a TP group killed mid-run: every other rank must raise within its spin bound, none hang.

    python3 -m tests.multigpu.kill --tp 2 --procs-per-gpu [--kill-rank 1] [--spin-timeout-ms 3000]

torchrun tears the whole job down when a rank dies, so this driver starts the ranks itself: ``tp``
processes of ``python3 -m tests.multigpu.run --tp N --kill-rank R`` with the environment torchrun
would give them (``MASTER_ADDR``, a free ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``) and the no-multicast variables. Each builds a ``LamportAllReduce`` with a
short spin bound, makes checked calls, then rank R SIGKILLs itself (having published nothing for
the next call) and every other rank calls on: its calls must raise ``LamportTimeoutError`` (or a
CUDA error, where the dead process's memory went with it) within the bound plus slack, and the call
after that must raise again. Each survivor prints a ``KILL-RESULT`` line and exits 0 (raised in
time) or 1; the killed rank must end by SIGKILL. A rank still running after ``--timeout-s`` is
killed and counts as hung (a failure). Prints each rank's output, one PASS / FAIL line per rank and
"multigpu: N passed, M failed"; exit status 1 when any failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [str(ROOT / "packages" / package / "src") for package in ("mhc-core", "mhc-dsv41", "mhc-glm5")]
#: NVLink multicast stays off in every rank (filled in where unset, as tests.multigpu.run does).
NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
RESULT_PREFIX = "KILL-RESULT "


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m tests.multigpu.kill", description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, required=True, choices=(2, 4, 8))
    parser.add_argument("--kill-rank", type=int, help="the rank that kills itself (default: the last)")
    parser.add_argument("--procs-per-gpu", action="store_true", help="every rank on GPU rank %% device_count, gloo")
    parser.add_argument("--spin-timeout-ms", type=float, default=3000.0, help="the op's spin bound")
    parser.add_argument("--slack-s", type=float, default=5.0, help="seconds a survivor may take beyond the bound")
    parser.add_argument("--good-calls", type=int, default=20, help="checked calls before the kill")
    parser.add_argument(
        "--protocol",
        choices=("one-shot", "two-shot"),
        default="one-shot",
        help="one-shot: the plain LamportAllReduce; two-shot: DSV4.1's fused op forced to the two-shot (issue #47)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="kill every rank still running after this (startup and compiles included); a minute past the "
        "bound plus slack once the first rank has ended",
    )
    options = parser.parse_args(argv)
    if options.kill_rank is None:
        options.kill_rank = options.tp - 1
    if not 0 <= options.kill_rank < options.tp:
        parser.error(f"--kill-rank: expected a rank in [0, {options.tp}), got {options.kill_rank}")
    return options


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_env(base: Mapping[str, str], *, rank: int, tp: int, port: int) -> dict[str, str]:
    """What torchrun gives a rank of a one-node job, the sources on PYTHONPATH, multicast off."""
    env = dict(base)
    for name, value in NO_MULTICAST.items():
        env.setdefault(name, value)
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([*SOURCES, str(ROOT), *([existing] if existing else [])])
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(tp),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(tp),
        GROUP_RANK="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def child_command(options: argparse.Namespace) -> list[str]:
    command = [
        sys.executable, "-m", "tests.multigpu.run", "--tp", str(options.tp), "--kill-rank", str(options.kill_rank),
        "--kill-spin-ms", str(options.spin_timeout_ms), "--kill-slack-s", str(options.slack_s),
        "--kill-good-calls", str(options.good_calls), "--kill-protocol", options.protocol,
    ]  # fmt: skip
    if options.procs_per_gpu:
        command.append("--procs-per-gpu")
    return command


@dataclass
class RankRun:
    rank: int
    returncode: int | None  # None: still running at the deadline (then killed)
    output: str
    seconds: float

    @property
    def hung(self) -> bool:
        return self.returncode is None


def run_ranks(
    command: Sequence[str],
    tp: int,
    *,
    timeout_s: float,
    grace_s: float | None = None,
    base_env: Mapping[str, str] | None = None,
) -> list[RankRun]:
    """Start ``tp`` ranks of ``command`` (each its own env) and wait for all of them: up to
    ``timeout_s`` in all, and up to ``grace_s`` after the first rank ended (the killed one, or one
    that failed: its peers raise or wait in a collective that cannot complete); SIGKILL any still
    running then. Every rank's exit code and output (stdout and stderr)."""
    port = free_port()
    base = os.environ if base_env is None else base_env
    with tempfile.TemporaryDirectory(prefix="mhc-kill-") as folder:
        logs = [open(Path(folder) / f"rank{rank}.log", "w+b") for rank in range(tp)]  # noqa: SIM115
        start = time.monotonic()
        processes = [
            subprocess.Popen(
                list(command),
                cwd=ROOT,
                env=rank_env(base, rank=rank, tp=tp, port=port),
                stdin=subprocess.DEVNULL,
                stdout=logs[rank],
                stderr=subprocess.STDOUT,
            )
            for rank in range(tp)
        ]
        ended: dict[int, float] = {}
        deadline = timeout_s
        while len(ended) < tp and time.monotonic() - start < deadline:
            for rank, process in enumerate(processes):
                if rank not in ended and process.poll() is not None:
                    ended[rank] = time.monotonic() - start
                    if grace_s is not None:
                        deadline = min(deadline, ended[rank] + grace_s)
            time.sleep(0.05)
        runs = []
        for rank, process in enumerate(processes):
            returncode = process.poll()
            if returncode is None:  # hung: this driver's own child, killed by its pid
                process.kill()
                process.wait()
            logs[rank].seek(0)
            output = logs[rank].read().decode(errors="replace")
            logs[rank].close()
            runs.append(RankRun(rank, returncode, output, ended.get(rank, time.monotonic() - start)))
    return runs


def parse_result(output: str) -> dict[str, str] | None:
    """The fields of a survivor's ``KILL-RESULT`` line, None without one."""
    for line in output.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(field.split("=", 1) for field in line[len(RESULT_PREFIX) :].split() if "=" in field)
    return None


def judge(runs: Sequence[RankRun], victim: int) -> list[tuple[bool, str]]:
    """One verdict per rank: the victim died by SIGKILL (after its good calls); every survivor
    exited 0 with an ok result line (raised in time); none hung."""
    verdicts = []
    for run in runs:
        if run.hung:
            verdicts.append((False, f"rank {run.rank}: still running after {run.seconds:.1f} s: hung, killed"))
            continue
        if run.rank == victim:
            died = run.returncode == -signal.SIGKILL
            announced = f"KILL rank={run.rank}" in run.output
            if died and announced:
                verdicts.append((True, f"rank {run.rank}: killed itself (SIGKILL) after its good calls"))
            else:
                expected = f"rank {run.rank}: expected to kill itself after its good calls"
                verdicts.append((False, f"{expected}; exit code {run.returncode}"))
            continue
        result = parse_result(run.output)
        if result is None:
            verdicts.append((False, f"rank {run.rank}: exit code {run.returncode}, no {RESULT_PREFIX.strip()} line"))
            continue
        ok = run.returncode == 0 and result.get("ok") == "1"
        described = (
            f"rank {run.rank}: {result.get('error')} after {result.get('seconds')} s (bound {result.get('bound')} s, "
            f"call {result.get('calls')}, missing ranks {result.get('missing')}), next call {result.get('again')}"
        )
        verdicts.append((ok, described if ok else f"{described}; exit code {run.returncode}"))
    return verdicts


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    mode = "processes per GPU" if options.procs_per_gpu else "one process per GPU"
    print(
        f"multigpu kill tp={options.tp} ({mode}): rank {options.kill_rank} SIGKILLs itself after "
        f"{options.good_calls} good calls; spin bound {options.spin_timeout_ms:.0f} ms + {options.slack_s:.1f} s slack",
        flush=True,
    )
    start = time.monotonic()
    # After the kill every survivor must be done within its bound; the rest is generous (its exit).
    grace = options.spin_timeout_ms / 1000 + options.slack_s + 60.0
    runs = run_ranks(child_command(options), options.tp, timeout_s=options.timeout_s, grace_s=grace)
    for run in runs:
        for line in run.output.splitlines():
            print(f"[rank {run.rank}] {line}")
    verdicts = judge(runs, options.kill_rank)
    for ok, described in verdicts:
        print(f"{'PASS' if ok else 'FAIL'} tp={options.tp} kill rank {options.kill_rank}: {described}")
    passed = sum(ok for ok, _ in verdicts)
    print(f"multigpu kill tp={options.tp}: {time.monotonic() - start:.1f} s in total")
    print(f"multigpu: {passed} passed, {len(verdicts) - passed} failed", flush=True)
    return 0 if passed == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
