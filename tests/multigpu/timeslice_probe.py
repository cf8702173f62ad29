"""How two processes' spinning kernels share one GPU (issue #31): the smallest probe.

    python3 -m tests.multigpu.timeslice_probe [--rounds 200] [--sync-rounds 50] [--no-mps]

Two processes on GPU 0. Rank 0 allocates a four-word int32 flag with torch and hands it to rank 1
through a ``torch.multiprocessing`` queue (spawn context: a CUDA tensor travels as a CUDA IPC
handle). Each process then launches, round after round, a one-thread kernel that stores its round
into ``flag[self]`` and spins (volatile loads) until ``flag[other]`` holds that round too, reading
``%globaltimer`` at entry and exit. Nothing can hang: a kernel gives up after ``--kernel-timeout-ms``
and sets an abort word that makes every later kernel return at once; each configuration has a
deadline, after which its processes are killed.

Two phases per configuration: ``rounds`` kernels queued back to back (the period between one
kernel's exit and the next one's, from the device timer), then ``sync-rounds`` rounds each launched
and synchronised by the host (host wall time per round). Without MPS the two CUDA contexts
time-slice: a spinning kernel keeps the GPU until its slice ends, so the period is about one
slice; with MPS (``nvidia-cuda-mps-control -d``, started and stopped here when the binary exists)
both kernels run at once and a round takes microseconds.

The kernel is hand-written PTX loaded through the CUDA driver API (``libcuda.so.1``, ctypes), so the
probe needs only torch and a driver: no CuPy, Triton, NVRTC or compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: One thread. ``flag``: int32 [rank 0's round, rank 1's round, abort, -]; ``stamps``: int64
#: [slots, 3]: globaltimer at entry and at exit, then the poll count, -1 (timed out: the abort word
#: is set) or -2 (aborted on entry).
PTX = r"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry pingpong(
    .param .u64 p_flag,
    .param .u32 p_self,
    .param .u32 p_other,
    .param .u32 p_round,
    .param .u64 p_timeout_ns,
    .param .u64 p_stamps,
    .param .u32 p_slot
)
{
    .reg .pred %p<4>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<16>;

    ld.param.u64 %rd1, [p_flag];
    ld.param.u32 %r1, [p_self];
    ld.param.u32 %r2, [p_other];
    ld.param.u32 %r3, [p_round];
    ld.param.u64 %rd2, [p_timeout_ns];
    ld.param.u64 %rd3, [p_stamps];
    ld.param.u32 %r7, [p_slot];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd3, %rd3;
    mov.u64 %rd4, %globaltimer;
    mul.wide.u32 %rd5, %r7, 24;
    add.u64 %rd6, %rd3, %rd5;
    st.global.u64 [%rd6], %rd4;
    mov.u64 %rd11, 0;
    ld.volatile.global.u32 %r4, [%rd1+8];
    setp.ne.u32 %p1, %r4, 0;
    @%p1 bra ABORTED;
    mul.wide.u32 %rd7, %r1, 4;
    add.u64 %rd8, %rd1, %rd7;
    st.volatile.global.u32 [%rd8], %r3;
    membar.gl;
    mul.wide.u32 %rd9, %r2, 4;
    add.u64 %rd10, %rd1, %rd9;
SPIN:
    ld.volatile.global.u32 %r5, [%rd10];
    setp.ge.s32 %p2, %r5, %r3;
    @%p2 bra DONE;
    add.u64 %rd11, %rd11, 1;
    mov.u64 %rd12, %globaltimer;
    sub.u64 %rd13, %rd12, %rd4;
    setp.gt.u64 %p3, %rd13, %rd2;
    @%p3 bra TIMEOUT;
    bra.uni SPIN;
TIMEOUT:
    mov.u32 %r6, 1;
    st.volatile.global.u32 [%rd1+8], %r6;
    membar.gl;
    mov.u64 %rd11, -1;
    bra.uni DONE;
ABORTED:
    mov.u64 %rd11, -2;
DONE:
    mov.u64 %rd12, %globaltimer;
    st.global.u64 [%rd6+8], %rd12;
    st.global.u64 [%rd6+16], %rd11;
    ret;
}
"""

TIMED_OUT, ABORTED = -1, -2
#: Whole-probe bound: configurations share it (the MPS one gets what is left, at most its own).
TOTAL_DEADLINE_S = 55.0
BARRIER_TIMEOUT_S = 20.0


class Kernel:
    """``pingpong`` loaded into the current (torch's primary) context through the driver API."""

    def __init__(self) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        self.cuda = cuda
        cuda.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        cuda.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        cuda.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        cuda.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        cuda.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
        ]  # fmt: skip
        context = ctypes.c_void_p()
        self.check(cuda.cuCtxGetCurrent(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            raise RuntimeError("no current CUDA context: touch the device with torch first")
        module = ctypes.c_void_p()
        self.check(cuda.cuModuleLoadData(ctypes.byref(module), PTX.encode() + b"\0"), "cuModuleLoadData")
        self.function = ctypes.c_void_p()
        self.check(cuda.cuModuleGetFunction(ctypes.byref(self.function), module, b"pingpong"), "cuModuleGetFunction")

    def check(self, result: int, what: str) -> None:
        if result:
            name = ctypes.c_char_p()
            self.cuda.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"{what}: {(name.value or b'?').decode()} ({result})")

    def launch(self, stream: int, flag: int, me: int, other: int, round_: int, timeout_ns: int, stamps: int, slot: int):
        values = [
            ctypes.c_uint64(flag), ctypes.c_uint32(me), ctypes.c_uint32(other), ctypes.c_uint32(round_),
            ctypes.c_uint64(timeout_ns), ctypes.c_uint64(stamps), ctypes.c_uint32(slot),
        ]  # fmt: skip
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(value) for value in values])
        self.check(self.cuda.cuLaunchKernel(self.function, 1, 1, 1, 1, 1, 1, 0, stream, params, None), "cuLaunchKernel")


def worker(rank: int, config: dict, handoff, results, barrier) -> None:
    """One of the two processes (spawned: imports torch, touches GPU 0)."""
    import torch

    try:
        torch.cuda.set_device(0)
        if rank == 0:
            flag = torch.zeros(4, dtype=torch.int32, device="cuda")
            torch.cuda.synchronize()
            handoff.put(flag)
        else:
            flag = handoff.get(timeout=BARRIER_TIMEOUT_S)
        rounds, sync_rounds = config["rounds"], config["sync_rounds"]
        stamps = torch.zeros(rounds + sync_rounds + 1, 3, dtype=torch.int64, device="cuda")
        kernel = Kernel()
        stream = torch.cuda.Stream()
        timeout_ns = int(config["kernel_timeout_ms"] * 1e6)
        other, flag_address, stamps_address = 1 - rank, flag.data_ptr(), stamps.data_ptr()

        def launch(round_: int, slot: int) -> None:
            kernel.launch(stream.cuda_stream, flag_address, rank, other, round_, timeout_ns, stamps_address, slot)

        launch(0, rounds + sync_rounds)  # round 0 is always met: loads nothing lazily later
        torch.cuda.synchronize()
        barrier.wait(BARRIER_TIMEOUT_S)
        start = time.perf_counter()
        for index in range(rounds):  # queued back to back
            launch(1 + index, index)
        stream.synchronize()
        queued_s = time.perf_counter() - start
        barrier.wait(BARRIER_TIMEOUT_S)
        host = []
        for index in range(sync_rounds):  # each launched and synchronised by the host
            begin = time.perf_counter()
            launch(1 + rounds + index, rounds + index)
            stream.synchronize()
            host.append(time.perf_counter() - begin)
        results.put(dict(rank=rank, stamps=stamps.cpu().tolist(), host=host, queued_s=queued_s, error=None))
        del flag
        torch.cuda.synchronize()
        barrier.wait(BARRIER_TIMEOUT_S)  # rank 0 keeps the flag alive until rank 1 has let it go
    except Exception as error:  # reported by the parent; the barrier breaks for the peer
        results.put(dict(rank=rank, error=f"{type(error).__name__}: {error}"))
        barrier.abort()


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def summarize(result: dict, rounds: int) -> dict:
    """Per-rank figures: the queued phase's period and spin (device timer) and the synced phase's
    host round trip, in microseconds; counts of timed-out and aborted kernels."""
    stamps = result["stamps"]
    queued = stamps[:rounds]
    exits = [row[1] for row in queued]
    periods = [(b - a) / 1e3 for a, b in itertools.pairwise(exits)][1:]  # the first absorbs start skew
    spins = [(row[1] - row[0]) / 1e3 for row in queued[1:]]
    polls = [row[2] for row in queued if row[2] >= 0]
    statuses = [row[2] for row in stamps[:-1]]
    host = [seconds * 1e6 for seconds in result["host"]]
    return dict(
        period_median=statistics.median(periods) if periods else float("nan"),
        period_p99=percentile(periods, 0.99),
        spin_median=statistics.median(spins) if spins else float("nan"),
        spin_p99=percentile(spins, 0.99),
        polls_median=statistics.median(polls) if polls else float("nan"),
        host_median=statistics.median(host) if host else float("nan"),
        host_p99=percentile(host, 0.99),
        queued_per_round=result["queued_s"] * 1e6 / max(1, rounds),
        timed_out=statuses.count(TIMED_OUT),
        aborted=statuses.count(ABORTED),
    )


def run_configuration(label: str, config: dict, deadline_s: float) -> list[tuple[str, int, dict | str]]:
    """Spawn the two processes, collect their results within ``deadline_s``, kill any left."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    handoff, results, barrier = context.Queue(), context.Queue(), context.Barrier(2)
    processes = [
        context.Process(target=worker, args=(rank, config, handoff, results, barrier), daemon=True) for rank in (0, 1)
    ]
    for process in processes:
        process.start()
    end = time.monotonic() + deadline_s
    received: dict[int, dict] = {}
    while len(received) < 2 and time.monotonic() < end:
        try:
            result = results.get(timeout=0.2)
        except queue.Empty:
            if all(not process.is_alive() for process in processes) and results.empty():
                break
            continue
        received[result["rank"]] = result
    for process in processes:
        process.join(timeout=max(0.0, min(5.0, end - time.monotonic())))
        if process.is_alive():  # this probe's own child, by its pid
            process.kill()
            process.join(timeout=5.0)
    rows: list[tuple[str, int, dict | str]] = []
    for rank in (0, 1):
        result = received.get(rank)
        if result is None:
            rows.append((label, rank, f"no result within {deadline_s:.0f} s (exit code {processes[rank].exitcode})"))
        elif result["error"]:
            rows.append((label, rank, result["error"]))
        else:
            rows.append((label, rank, summarize(result, config["rounds"])))
    return rows


def start_mps(binary: str) -> dict[str, str] | None:
    """An MPS control daemon with its own pipe and log folders; the variables its clients need."""
    folder = Path(tempfile.mkdtemp(prefix="mhc-mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in env.values():
        Path(path).mkdir()
    try:
        started = subprocess.run([binary, "-d"], env={**os.environ, **env}, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"MPS: could not start the daemon: {error}")
        return None
    if started.returncode:
        print(f"MPS: '{binary} -d' exited {started.returncode}: {started.stderr.decode(errors='replace').strip()}")
        return None
    time.sleep(0.5)
    return env


def stop_mps(binary: str, env: dict[str, str]) -> None:
    try:
        stopped = subprocess.run([binary], input=b"quit\n", env={**os.environ, **env}, capture_output=True, timeout=15)
        print(f"MPS: daemon stopped ('quit' exited {stopped.returncode})")
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"MPS: stopping the daemon failed: {error}")
    log = Path(env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    if log.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        for line in tail:
            print(f"MPS control.log: {line}")


def print_table(rows: Sequence[tuple[str, int, dict | str]]) -> None:
    header = (
        f"{'configuration':<14} {'rank':>4} {'period us p50':>13} {'p99':>9} {'spin us p50':>11} {'p99':>9} "
        f"{'polls p50':>9} {'synced us p50':>13} {'p99':>9} {'timeouts':>8}"
    )
    print(header)
    print("-" * len(header))
    for label, rank, figures in rows:
        if isinstance(figures, str):
            print(f"{label:<14} {rank:>4} {figures}")
            continue
        print(
            f"{label:<14} {rank:>4} {figures['period_median']:>13.1f} {figures['period_p99']:>9.1f} "
            f"{figures['spin_median']:>11.1f} {figures['spin_p99']:>9.1f} {figures['polls_median']:>9.0f} "
            f"{figures['host_median']:>13.1f} {figures['host_p99']:>9.1f} "
            f"{figures['timed_out'] + figures['aborted']:>8}"
        )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m tests.multigpu.timeslice_probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=200, help="kernels queued back to back per process")
    parser.add_argument("--sync-rounds", type=int, default=50, help="rounds each launched and synchronised")
    parser.add_argument("--kernel-timeout-ms", type=float, default=1000.0, help="a kernel's spin bound")
    parser.add_argument("--deadline-s", type=float, default=25.0, help="per configuration, then its processes die")
    parser.add_argument("--no-mps", action="store_true", help="skip the MPS configuration")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    config = dict(rounds=options.rounds, sync_rounds=options.sync_rounds, kernel_timeout_ms=options.kernel_timeout_ms)
    began = time.monotonic()
    binary = shutil.which("nvidia-cuda-mps-control")
    print(f"nvidia-cuda-mps-control: {binary or 'not found'}")
    default_pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"
    if default_pipe.exists():
        print(f"note: an MPS control pipe exists at {default_pipe}: the 'no MPS' processes may be MPS clients")
    rows = run_configuration("no MPS", config, options.deadline_s)
    if binary and not options.no_mps:
        left = TOTAL_DEADLINE_S - (time.monotonic() - began) - 5.0
        env = start_mps(binary) if left > 5.0 else None
        if env is not None:
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)  # the spawned processes inherit them: MPS clients
            try:
                rows += run_configuration("MPS", config, min(options.deadline_s, left))
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
                stop_mps(binary, env)
    print(
        f"\n{options.rounds} queued rounds (period: one kernel's exit to the next one's; spin: a kernel's own time) "
        f"and {options.sync_rounds} synchronised rounds (host wall time) per process; kernel bound "
        f"{options.kernel_timeout_ms:.0f} ms"
    )
    print_table(rows)
    for label, rank, figures in rows:
        if rank == 0 and isinstance(figures, dict):
            period = figures["period_median"]
            kind = "time-sliced: about one slice per round" if period > 100 else "concurrent"
            print(f"{label}: median period {period:.1f} us -> {kind}")
    print(f"probe: {time.monotonic() - began:.1f} s")
    failed = any(isinstance(figures, str) for _, _, figures in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
