"""The benchmark tools' host side without a GPU: the A/B table and its argument checks; the tp > 1
floor with the mailbox bytes; the host suite's table and rounds; the suites, defaults and tables the
registered models declare; the host-instruction counts. (A model's own suites: ``tests/<key>/``.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ab_table_gives_medians_and_ratios() -> None:
    from benchmarks.ab import table

    def run(first: float, second: float) -> dict:
        return {"one": {1: first}, "two": {1: second}}

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
    from mhc_core.bench.floors import mailbox_bytes, mailbox_floor
    from mhc_core.bench.records import Record

    assert mailbox_bytes(4, 5120, 1) == 0 and mailbox_bytes(4, 5120, 2) == 3 * 2 * 4 * 5120 * 2
    context = SimpleNamespace(tp=2, bandwidth=1000.0)
    assert mailbox_floor(context, 1000, 4, 5120) == (1000 + 3 * 2 * 4 * 5120 * 2) / 1000.0
    assert mailbox_floor(SimpleNamespace(tp=1, bandwidth=1000.0), 1000, 4, 5120) is None
    records = [Record("suite", 2, 8, "fused op", 20.0, 5.0, 10.0), Record("suite", 2, 8, "eager", 90.0, 5.0)]
    text = table(records)
    assert "| byte floor | fused / floor | floor with mailbox | fused / that |" in text
    assert "| 8 | 20.0 | 90.0 | 5.0 | 4.00 | 10.0 | 2.00 |" in text
    assert "floor with mailbox" not in table([Record("suite", 1, 8, "fused op", 2.0, 1.0)])


def test_host_table_pairs_host_best_and_wall_and_sets_every_path_beside_rms_norm() -> None:
    from benchmarks.report import host_table
    from mhc_core.bench.records import Record

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


# ------------------------------------------------------------------ the registry's suites
def test_every_declared_suite_table_and_default_is_the_runs() -> None:
    """``benchmarks.run`` takes each model's suites, plain-run defaults and tables from its registry
    entry (``Model.benchmark_suites``, ``benchmark_defaults``, ``benchmark_tables``), after core."""
    from benchmarks import run
    from mhc_core import registry

    models = registry.models().values()
    for model in models:
        for name, target in model.benchmark_suites:
            assert run.RUNNERS[name] is registry.load_object(target), name
        for name, target in model.benchmark_tables:
            assert run.TABLES[name] is registry.load_object(target), name
        assert set(model.benchmark_defaults) <= {name for name, _ in model.benchmark_suites}, model.key
    defaults = ("core", *(name for model in models for name in model.benchmark_defaults))
    assert defaults == run.DEFAULT_SUITES
    assert {"core", "spin-bound", "host", "fp8"} <= set(run.SUITES) and run.SUITES[0] == "core"


def test_every_benchmark_case_is_complete() -> None:
    """What the generic suites call of each model's case (``mhc_core.bench.case.BenchmarkCase``)."""
    from mhc_core.bench.case import BenchmarkCase, cases

    found = cases()
    assert found, "no registered model declares a benchmark case"
    for case in found:
        for name in BenchmarkCase.__annotations__:
            assert hasattr(case, name), (case, name)
        for name in ("preset", "build", "inputs", "bytes", "join", "step", "host_steps"):
            assert callable(getattr(case, name)), (case, name)
        assert case.preset(2).endswith(f"-tp2-h{case.hidden}")
        assert case.bytes(8, case.hidden) > case.bytes(1, case.hidden) > 0


def test_ab_loads_this_checkouts_cases_by_file() -> None:
    """``benchmarks.ab`` hands its children this checkout's case and timing files (an older tree has none)."""
    from benchmarks.ab import this_checkout
    from benchmarks.checkout import load_file
    from mhc_core import registry

    loaded = this_checkout()
    assert set(loaded["cases"]) == {key for key, model in registry.models().items() if model.benchmark_case}
    assert loaded["distributions"] == ["mhc-core", *registry.distributions()]
    for key, (path, name) in loaded["cases"].items():
        assert getattr(load_file(f"_test_case_{key}", path), name).key == key
    assert callable(load_file("_test_timing", loaded["timing"]).graph_time_us)


# ------------------------------------------------------------------ host instructions (callgrind)
def test_host_instructions_reads_each_paths_dump(tmp_path) -> None:
    from benchmarks.host_instructions import totals

    (tmp_path / "callgrind.7.1").write_text("desc: Trigger: Client Request: dsv call\nsummary: 0\ntotals: 5000\n")
    (tmp_path / "callgrind.7.2").write_text("desc: Trigger: Client Request: glm call + join\ntotals: 9000\n")
    (tmp_path / "callgrind.7").write_text("desc: Trigger: Program termination\ntotals: 1\n")
    assert totals(tmp_path, 10) == {"dsv call": 500.0, "glm call + join": 900.0}


def test_host_instructions_worker_runs_every_path(tmp_path) -> None:
    """The worker outside valgrind (its client requests do nothing there): every path runs on this tree."""
    from benchmarks.host_instructions import client_requests, plan

    if shutil.which("gcc") is None or not Path("/usr/include/valgrind/callgrind.h").exists():
        pytest.skip("needs gcc and valgrind's callgrind.h (the client requests' library)")
    library = client_requests(tmp_path)
    root = Path(__file__).resolve().parents[2]
    planned = json.dumps(plan())
    command = [sys.executable, "-m", "benchmarks.host_instructions", "--worker", str(root), str(library), "3", planned]
    env = {**os.environ, "MHC_CACHE_DIR": str(tmp_path / "cache")}
    subprocess.run(command, cwd=root, env=env, check=True, capture_output=True, timeout=600)


def test_kernel_split_charges_overlapping_kernels_once() -> None:
    """``benchmarks.kernel_split``: a PDL-overlapped kernel is charged from its predecessor's end;
    kinds by name (anything else is the boundary)."""
    from benchmarks.kernel_split import charge, kind_of

    assert [kind_of(n) for n in ("kernel_PublishKernel_x", "ReduceKernel", "FinalizePublish", "MHC")] == [
        "publish",
        "reduce",
        "finalize",
        "boundary",
    ]
    kernels = [("Publish", 0.0, 4.0), ("Reduce", 3.0, 6.0), ("Boundary", 5.0, 15.0), ("Publish", 20.0, 21.0)]
    assert charge(kernels) == {"publish": 5.0, "reduce": 2.0, "boundary": 9.0}
