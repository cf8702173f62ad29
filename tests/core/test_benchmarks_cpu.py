"""The benchmark tools' host side without a GPU: the A/B table and its argument checks; the tp > 1
floor with the mailbox bytes; the glm5-overlap suite's registration, GEMM shape, variants (traced on
fake tensors), order check and table; the persistent GLM suite's registration."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_ab_table_gives_medians_and_ratios() -> None:
    from benchmarks.ab import table

    def run(dsv: float, glm: float) -> dict:
        return {"dsv41": {1: dsv}, "glm5": {1: glm}}

    runs = {
        "before": [run(3.0, 5.0), run(3.2, 5.2), run(3.1, 5.1)],
        "after": [run(2.0, 5.1), run(2.2, 5.0), run(2.1, 5.2)],
    }
    text = table(runs)
    assert "| 1 | 3.10 (1.000) | 2.10 (0.677) |" in text
    assert "| 1 | 5.10 (1.000) | 5.10 (1.000) |" in text
    assert "median us per call of 3 alternating runs (ratio to before)" in text


def test_ab_refuses_fewer_than_two_trees(tmp_path: Path) -> None:
    (tmp_path / "packages").mkdir()
    command = [sys.executable, "-m", "benchmarks.ab", "--tree", f"one={tmp_path}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "expected two or more TAG=DIR" in done.stderr


def test_mailbox_floor_counts_every_ranks_slots_three_times() -> None:
    """At tp > 1 the second floor adds each rank's slot written into this GPU's mailbox, read and
    re-armed (3 x tp x M x hidden x 2 bytes); the table shows it beside the first for fused rows."""
    from types import SimpleNamespace

    from benchmarks.report import table
    from benchmarks.suites import Record, mailbox_bytes, mailbox_floor

    assert mailbox_bytes(4, 5120, 1) == 0 and mailbox_bytes(4, 5120, 2) == 3 * 2 * 4 * 5120 * 2
    context = SimpleNamespace(tp=2, bandwidth=1000.0)
    assert mailbox_floor(context, 1000, 4, 5120) == (1000 + 3 * 2 * 4 * 5120 * 2) / 1000.0
    assert mailbox_floor(SimpleNamespace(tp=1, bandwidth=1000.0), 1000, 4, 5120) is None
    records = [Record("dsv41", 2, 8, "fused AllReduceMHC", 20.0, 5.0, 10.0), Record("dsv41", 2, 8, "eager", 90.0, 5.0)]
    text = table(records)
    assert "| byte floor | fused / floor | floor with mailbox | fused / that |" in text
    assert "| 8 | 20.0 | 90.0 | 5.0 | 4.00 | 10.0 | 2.00 |" in text
    assert "floor with mailbox" not in table([Record("dsv41", 1, 8, "fused AllReduceMHC", 2.0, 1.0)])


def test_persistent_glm_suite_is_registered() -> None:
    from benchmarks.run import RUNNERS, SUITES

    assert "glm5-persistent" in SUITES and RUNNERS["glm5-persistent"].__name__ == "glm5_persistent"


def test_host_table_pairs_host_best_and_wall_and_sets_every_path_beside_rms_norm() -> None:
    from benchmarks.report import host_table
    from benchmarks.suites import Record

    records = [
        Record("host", 1, 1, "torch F.rms_norm | host", 8.0, 4.5),
        Record("host", 1, 1, "torch F.rms_norm | best", 5.0, 4.5),
        Record("host", 1, 1, "op | host", 10.0, 4.5),
        Record("host", 1, 1, "op | best", 6.0, 4.5),
        Record("host", 1, 1, "op | wall", 11.0, 4.5),
    ]
    table = host_table(records)
    assert "| op | 1 | 1 | 10.0 | 1.25 | 6.0 | 1.20 | 11.0 | 4.5 |" in table
    assert "| torch F.rms_norm | 1 | 1 | 8.0 | 1.00 | 5.0 | 1.00 | nan | 4.5 |" in table


def test_interleaved_rounds_time_every_step_in_each_round(monkeypatch) -> None:
    """Each round runs a burst of every step in turn (a slow spell of a shared host falls on all
    paths alike); a step of two calls (loopback ranks) is timed per call."""
    from benchmarks import host

    order: list[str] = []
    monkeypatch.setattr(host.torch.cuda, "synchronize", lambda: None)
    steps = [host.Step("a", 1, lambda: order.append("a"), 1), host.Step("b", 2, lambda: order.append("b"), 2, 2)]
    measured = host.interleaved_us(steps, rounds=3, burst=2)
    assert order == ["a", "a", "b", "b"] + ["a", "a", "b", "b"] * 3
    assert set(measured) == {"a", "b"}
    median, best, wall = measured["a"]
    assert 0 <= best <= median <= wall


# ------------------------------------------------------------------ glm5-overlap
def test_overlap_suite_is_registered(monkeypatch) -> None:
    """``--suite glm5-overlap`` runs ``benchmarks.overlap`` at the --m values up to 64 and prints its own
    table; a plain run leaves it out (it compiles a dozen functions)."""
    from benchmarks import overlap, report, run

    seen = []
    monkeypatch.setattr(overlap, "glm5_overlap", lambda ctx, ms: seen.append(ms) or [])
    assert run.RUNNERS["glm5-overlap"](None, list(run.DEFAULT_M)) == []
    assert seen == [[1, 8, 64]]
    assert "glm5-overlap" in run.SUITES and "glm5-overlap" not in run.DEFAULT_SUITES
    assert run.TABLES["glm5-overlap"] is report.overlap_table


def test_overlap_gemm_is_the_demo_qkv_projection() -> None:
    from benchmarks.overlap import gemm_bytes, projection_shape

    assert projection_shape(1) == (4096, (32 + 2 * 8) * 128)
    assert projection_shape(2) == (4096, 3072)  # column-parallel: each rank holds half the heads
    assert gemm_bytes(8, 1) == 2 * (4096 * 6144 + 8 * 4096 + 8 * 6144)


def test_overlap_variants_trace_in_the_order_they_name() -> None:
    """Each variant traces into one graph (fake CUDA tensors, no GPU) calling the boundary, the GEMM
    and the join in the order its label gives; the suite checks inductor's generated code on the GPU."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mhc_glm5.library  # noqa: F401  (registers the ops)
    from benchmarks.overlap import VARIANTS

    m, hidden, mix = 3, 64, 24
    names = {"mhc.glm5_boundary": "boundary", "mhc.glm5_join": "join", str(F.linear): "gemm"}
    with FakeTensorMode():
        bf16, f32 = torch.bfloat16, torch.float32
        state = torch.empty(4, dtype=torch.int32, device="cuda")
        op = SimpleNamespace(state=state, handle=7)
        inputs = [
            torch.empty(shape, dtype=dtype, device="cuda")
            for shape, dtype in (
                ((96, hidden), bf16),  # the projection, [out, in]
                ((m, hidden), bf16), ((m, 4, hidden), bf16), ((m, 4, 1), f32),
                ((m, 4, 4), f32), ((mix, 4 * hidden), bf16), ((3,), f32), ((mix,), f32), ((hidden,), bf16),
            )
        ]  # fmt: skip
        for label, (function, expected) in VARIANTS.items():
            graphs = []

            def backend(gm, example_inputs, graphs=graphs):
                graphs.append(gm)
                return gm.forward

            torch._dynamo.reset()
            torch.compile(function, fullgraph=True, backend=backend)(op, *inputs)
            assert len(graphs) == 1, label
            calls = [names[str(n.target)] for n in graphs[0].graph.nodes if str(n.target) in names]
            assert tuple(calls) == expected, f"{label}: {calls}"


def test_overlap_call_order_reads_the_generated_call() -> None:
    """The order check reads the calls of inductor's ``call`` function, not its comments."""
    from benchmarks.overlap import call_order

    code = """
def triton_poi_fused_0(in_ptr0, ...): pass  # mhc.glm5_join in a kernel name does not count
class Runner:
    def call(self, args):
        # Topologically Sorted Source Nodes: [glm5_join], Original ATen: [mhc.glm5_join]
        buf0 = torch.ops.mhc.glm5_boundary.default(arg1_1, 1, arg0_1)
        extern_kernels.mm(buf3, reinterpret_tensor(arg9_1, (4096, 6144), (1, 4096), 0), out=buf4)
        buf5 = torch.ops.mhc.glm5_join.default(arg1_1, 1, buf2)
"""
    assert call_order(code) == ("boundary", "gemm", "join")
    assert call_order(code.replace("extern_kernels.mm(buf3", "extern_kernels.bmm(buf3")) == ("boundary", "join")


def test_overlap_table_derives_the_hidden_time() -> None:
    from benchmarks.report import overlap_table
    from benchmarks.suites import Record

    times = {"(a) boundary + join": 6.0, "(b) qkv gemm": 14.0, "(c) boundary, gemm, join": 17.5,
             "(d) boundary, join, gemm": 20.0}  # fmt: skip
    records = [Record("glm5-overlap", 1, 8, label, us, 15.0) for label, us in times.items()]
    assert "| 1 | 8 | 6.00 | 14.00 | 20.00 | 17.50 | 20.00 | 2.50 |" in overlap_table(records)


# ------------------------------------------------------------------ host instructions (callgrind)
def test_host_instructions_reads_each_paths_dump(tmp_path) -> None:
    from benchmarks.host_instructions import totals

    (tmp_path / "callgrind.7.1").write_text("desc: Trigger: Client Request: dsv call\nsummary: 0\ntotals: 5000\n")
    (tmp_path / "callgrind.7.2").write_text("desc: Trigger: Client Request: glm call + join\ntotals: 9000\n")
    (tmp_path / "callgrind.7").write_text("desc: Trigger: Program termination\ntotals: 1\n")
    assert totals(tmp_path, 10) == {"dsv call": 500.0, "glm call + join": 900.0}


def test_host_instructions_worker_runs_every_path(tmp_path) -> None:
    """The worker outside valgrind (its client requests do nothing there): every path runs on this tree."""
    from benchmarks.host_instructions import client_requests

    if shutil.which("gcc") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        pytest.skip("needs gcc and valgrind's callgrind.h (the client requests' library)")
    library = client_requests(tmp_path)
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "benchmarks.host_instructions", "--worker", str(root), str(library), "3"]
    env = {**os.environ, "MHC_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run(command, cwd=root, env=env, check=True, capture_output=True, timeout=600)
