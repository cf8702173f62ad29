"""The multi-GPU runner and the kill driver without a GPU: options, each rank's device and backend, the
environment the driver gives its ranks, its verdicts (fake ranks that die, raise, or hang), a
survivor's verdict line, and the harness's own collectives and stress drivers (random calls, skew)
over a real two-process gloo group on CPU tensors (what the processes-per-GPU mode uses)."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.multigpu import kill, run


# --------------------------------------------------------------------------- options
def test_procs_per_gpu_options() -> None:
    options = run.parse_args(["--tp", "4", "--procs-per-gpu", "--only", "stress", "--calls-scale", "0.5"])
    assert options.tp == 4 and options.procs_per_gpu and options.only == ["stress"]
    assert options.kill_rank is None
    assert run.scaled(1000, options) == 500 and run.scaled(1, options) == 1
    assert not run.parse_args(["--tp", "2"]).procs_per_gpu
    assert run.parse_args(["--tp", "2", "--only", "fp8"]).only == ["fp8"]
    assert set(run.SUITES) == set(run.SUITE_NAMES)
    assert run.parse_args(["--tp", "8", "--protocol", "two-shot"]).protocol == "two-shot"


@pytest.mark.parametrize(
    "argv",
    [
        ["--tp", "3"],
        ["--tp", "2", "--kill-rank", "2"],
        ["--tp", "2", "--calls-scale", "0"],
        ["--tp", "2", "--only", "nothing"],
        ["--tp", "2", "--mailbox-allocation", "shared"],
        ["--tp", "2", "--protocol", "three-shot"],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        run.parse_args(argv)


def test_rank_devices_and_backends() -> None:
    assert [run.rank_device(rank, 1, True) for rank in range(8)] == [0] * 8
    assert [run.rank_device(rank, 2, True) for rank in range(4)] == [0, 1, 0, 1]
    assert run.rank_device(1, 2, False) == 1
    with pytest.raises(RuntimeError, match="--procs-per-gpu"):
        run.rank_device(2, 2, False)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        run.rank_device(0, 0, True)
    assert run.backend(True) == "gloo" and run.backend(False) == "nccl"


# ---------------------------------------------------------------------- the driver
def test_rank_env_is_what_torchrun_gives() -> None:
    env = kill.rank_env({"PYTHONPATH": "/elsewhere", "NCCL_NVLS_ENABLE": "1"}, rank=3, tp=4, port=29555)
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == "29555"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "3", "4")
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "1"  # set by the caller: kept, as tests.multigpu.run does
    paths = env["PYTHONPATH"].split(":")
    assert paths[-1] == "/elsewhere" and str(kill.ROOT) in paths
    assert any(path.endswith("mhc-core/src") for path in paths)


def test_child_command_is_a_kill_run_of_the_runner() -> None:
    options = kill.parse_args(["--tp", "4", "--procs-per-gpu", "--spin-timeout-ms", "2500"])
    assert options.kill_rank == 3  # the last rank unless told
    command = kill.child_command(options)
    assert command[:3] == [sys.executable, "-m", "tests.multigpu.run"]
    child = run.parse_args(command[3:])
    assert child.tp == 4 and child.kill_rank == 3 and child.procs_per_gpu
    assert child.kill_spin_ms == 2500.0 and child.kill_slack_s == options.slack_s
    assert child.kill_protocol == "one-shot"
    two_shot = run.parse_args(kill.child_command(kill.parse_args(["--tp", "4", "--protocol", "two-shot"]))[3:])
    assert two_shot.kill_protocol == "two-shot", "the kill of a fused op forced to the two-shot (issue #47)"
    with pytest.raises(SystemExit):
        kill.parse_args(["--tp", "2", "--kill-rank", "5"])


FAKE_RANK = """
import os, signal, sys, time
rank, victim = int(os.environ["RANK"]), int(sys.argv[1])
behaviour = sys.argv[2]
if rank == victim:
    print(f"KILL rank={rank}: fake", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if behaviour == "hang" and rank == 0:
    time.sleep(600)
ok = int(behaviour != "slow")
print(f"KILL-RESULT rank={rank} ok={ok} error=LamportTimeoutError seconds=3.100 bound=8.000 calls=1 "
      f"missing=[{victim}] again=LamportTimeoutError", flush=True)
sys.exit(1 - ok)
"""


def fake_ranks(tmp_path: Path, tp: int, victim: int, behaviour: str, **waits: float) -> list[kill.RankRun]:
    script = tmp_path / "fake_rank.py"
    script.write_text(textwrap.dedent(FAKE_RANK))
    return kill.run_ranks([sys.executable, str(script), str(victim), behaviour], tp, **waits)


def test_driver_passes_when_the_victim_dies_and_survivors_raise(tmp_path: Path) -> None:
    runs = fake_ranks(tmp_path, 4, 2, "good", timeout_s=60)
    assert [r.returncode for r in runs] == [0, 0, -9, 0]
    verdicts = kill.judge(runs, victim=2)
    assert all(ok for ok, _ in verdicts), verdicts
    assert "LamportTimeoutError after 3.100 s" in verdicts[0][1]
    assert kill.parse_result(runs[1].output)["missing"] == "[2]"


def test_driver_fails_a_slow_survivor_and_a_victim_that_lived(tmp_path: Path) -> None:
    runs = fake_ranks(tmp_path, 2, 1, "slow", timeout_s=60)
    verdicts = kill.judge(runs, victim=1)
    assert [ok for ok, _ in verdicts] == [False, True]
    assert "exit code 1" in verdicts[0][1]
    assert not kill.judge(runs, victim=0)[0][0]  # rank 0 did not die by SIGKILL


def test_driver_kills_a_hung_rank(tmp_path: Path) -> None:
    start = time.monotonic()
    runs = fake_ranks(tmp_path, 2, 1, "hang", timeout_s=60, grace_s=2.0)
    assert time.monotonic() - start < 30
    assert runs[0].hung and not runs[1].hung
    verdicts = kill.judge(runs, victim=1)
    assert not verdicts[0][0] and "hung" in verdicts[0][1]


# --------------------------------------------------------------- a survivor's line
def test_survivor_verdict() -> None:
    from mhc_core import LamportTimeoutError

    timeout = LamportTimeoutError("ranks [1] never published", stage=2, token=0, missing_ranks=(1,))
    ok, line = run.kill_result_line(0, timeout, 3.2, 8.0, 1, timeout)
    assert ok and line.startswith(kill.RESULT_PREFIX)
    fields = kill.parse_result(line)
    assert fields is not None
    assert (fields["ok"], fields["error"], fields["missing"]) == ("1", "LamportTimeoutError", "[1]")
    assert not run.kill_result_line(0, timeout, 9.0, 8.0, 1, timeout)[0]  # too late
    assert not run.kill_result_line(0, timeout, 3.2, 8.0, 1, None)[0]  # the next call did not raise
    assert not run.kill_result_line(0, None, 3.2, 8.0, 3, None)[0]  # nothing raised
    cuda = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert run.kill_result_line(0, cuda, 0.5, 8.0, 1, cuda)[0]
    other = ValueError("M mismatch")
    assert not run.kill_result_line(0, other, 0.5, 8.0, 1, other)[0]


# ----------------------------------------------- the harness's collectives under gloo
GLOO_RANK = """
import os, sys
import torch
import torch.distributed as dist
from tests.multigpu import run

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as the runner's processes-per-GPU mode
dist.init_process_group("gloo")
run.COLLECTIVE_DEVICE = torch.device("cpu")
rank = dist.get_rank()
values = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
values[0, 0] = -0.0
run.check_identical_across_ranks(values.bfloat16(), values, values.bfloat16()[1:])
copies = run.gather_bits(values.bfloat16() + rank)
assert [c.dtype for c in copies] == [torch.bfloat16] * 2 and copies[1].shape == (5, 6)
assert torch.equal(copies[1].float(), (values.bfloat16() + 1).float())
flipped = values.clone()
if rank == 1:
    flipped[2, 3] = -flipped[2, 3]
try:  # every rank sees every copy: both name rank 1
    run.check_identical_across_ranks(flipped)
except AssertionError as error:
    assert "rank 1 vs rank 0: 1 of 30 elements differ" in str(error), error
else:
    raise AssertionError("rank 1's flipped sign went unnoticed")
assert run.agree(True, 1.0 + rank) == (True, 2.0)
assert run.agree(rank == 0, 0.5) == (False, 0.5)
assert run.gather_objects(f"h{rank}") == ["h0", "h1"]

# The stress drivers over a stand-in op (doubles its input; close() is a barrier, like the ops').
run.synchronize = lambda: None
run.SKEW_S = 0.3


class Doubling:
    def __init__(self, offset):
        self.offset, self.closed = offset, False

    def __call__(self, x):
        return x * 2 + self.offset

    def check(self):
        pass

    def close(self):
        dist.barrier()
        self.closed = True


def random_calls(offset):
    generator = torch.Generator().manual_seed(5)  # alike on every rank, as the GPU suites' are

    def make_call(index, m):
        x = torch.randn(m, 8, generator=generator).bfloat16()
        return (x,), x

    def check_call(result, x):
        run.assert_bitwise_equal(result, x * 2, "doubled")

    op = Doubling(offset)
    try:
        return run.random_calls(op, rank, 40, 3, make_call, check_call)
    finally:
        assert op.closed


assert "40 calls" in random_calls(0.0)
try:  # rank 1's outputs are wrong: its check fails, and rank 0 sees the hashes differ
    random_calls(float(rank))
except AssertionError as error:
    assert ("call 0 (M = " if rank else "rank 1's outputs differ bitwise") in str(error), error
else:
    raise AssertionError("rank 1's wrong outputs went unnoticed")
detail = run.skewed(rank, 2, lambda: Doubling(0.0), lambda op: (op(torch.ones(3)),))
seconds = [float(part.split()[-2]) for part in detail.split(": ", 1)[1].split(", ")]
# The stand-in's construction and calls are not collective: only its close() waits for the late rank.
assert len(seconds) == 3 and (rank == 1 or seconds[2] > 0.2), detail
try:
    run.skewed(rank, 2, lambda: Doubling(float(rank)), lambda op: (op(torch.ones(3)),))
except AssertionError as error:
    assert "outputs differ bitwise" in str(error), error
else:
    raise AssertionError("different outputs went unnoticed")
dist.barrier()
dist.destroy_process_group()
print(f"GLOO-OK rank={rank}", flush=True)
"""


def test_harness_collectives_over_gloo_on_cpu(tmp_path: Path) -> None:
    script = tmp_path / "gloo_rank.py"
    script.write_text(textwrap.dedent(GLOO_RANK))
    runs = kill.run_ranks([sys.executable, str(script)], 2, timeout_s=120, grace_s=30)
    for r in runs:
        assert r.returncode == 0 and f"GLOO-OK rank={r.rank}" in r.output, r.output
