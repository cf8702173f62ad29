"""Issue #50: the latest-figures page (``python3 -m benchmarks.page``) rendered from a fixture of results
folders as ``benchmarks.run`` writes them, in a process of its own: the latest folder gives each figure
(repeats: their median), a branch's folder feeds none, the two-shot section appears once a two-shot file
does, the plots are drawn (or, without matplotlib, the page says so and is still written); the tree's own
BENCHMARKS.md is what its results render; ``nox -s bench`` regenerates the page after the suites."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parent / "bench_page_results"
#: The page's module run as ``python3 -m benchmarks.page`` would, with matplotlib made unimportable.
WITHOUT_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; runpy.run_module('benchmarks.page', run_name='__main__')"
)


def page(*args: str, results: Path, tmp_path: Path, code: str | None = None) -> subprocess.CompletedProcess:
    out, plots = tmp_path / "PAGE.md", tmp_path / "plots"
    head = ["-c", code] if code else ["-m", "benchmarks.page"]
    command = [sys.executable, *head, "--results", str(results), "--out", str(out), "--plots", str(plots), *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)


def results_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "results"
    shutil.copytree(FIXTURE, copy)
    return copy


def test_page_from_fixture_takes_each_figure_from_the_latest_run(tmp_path: Path) -> None:
    done = page(results=FIXTURE, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "PAGE.md").read_text()
    # M = 1 from the later run, the median of its three repeats; M = 8 and 64 left to the older run.
    assert "| 1 | 3.50 (x1) | 0.25 | 14.0 | 90.0 | 25.7 | 2026-01-02-bbbbbbb |" in text
    assert "| 8 | 6.00 (x1) | 0.50 | 12.0 | 120.0 | 20.0 | 2026-01-01-aaaaaaa |" in text
    assert "| 64 | 9.00 (x8) | 2.00 | 4.5 | 150.0 | 16.7 | 2026-01-01-aaaaaaa |" in text
    # tp 2: the floor with the mailbox traffic beside the byte floor.
    assert "| 256 | 30.00 (x16) | 6.00 | 5.0 | 9.00 | 3.3 | 420.0 | 14.0 | 2026-01-02-bbbbbbb |" in text
    # The branch's folder: listed in the history, never a figure.
    assert "0.50 (x1)" not in text and "| 1 | 0.5" not in text
    history = text[text.index("## History") :]
    rows = [line for line in history.splitlines() if line.startswith("| 2026-")]
    assert [row.split(" | ")[1] for row in rows] == ["third run", "second run", "first run"]
    assert "bench_page_results/2026-01-03-some-branch/NOTES.md)" in rows[0]  # a link relative to the page
    assert "## All-reduce protocols" not in text and "two-shot" not in text.split("## Method")[0].lower()


def test_two_shot_section_appears_with_a_two_shot_file(tmp_path: Path) -> None:
    results = results_copy(tmp_path)
    folder = results / "2026-01-04-ddddddd"
    folder.mkdir()
    records = [
        {"suite": "two-shot", "tp": 4, "m": m, "variant": f"model-a {protocol}", "us": us, "floor_us": 1.0,
         "mailbox_floor_us": floor, "note": None}
        for m, one, two in ((8, 9.0, 10.0), (64, 10.0, 8.0))
        for protocol, us, floor in (("one-shot", one, 2.0), ("two-shot", two, 1.5))
    ]  # fmt: skip
    header = {"date": "2026-01-04", "gpu": "Fixture GPU", "commit": "ddddddd", "tp": 4, "copy_bandwidth_tb_s": 4.0}
    (folder / "two-shot.json").write_text(json.dumps({**header, "records": records}))
    done = page(results=results, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "PAGE.md").read_text()
    assert "### All-reduce protocols: one-shot and two-shot (`--suite two-shot`)" in text
    assert "| 64 | 10.0 | 8.0 | 0.80 | 2.0 | 1.5 |" in text
    assert "crossover measured (loopback, the smallest M from which two-shot stays faster): 64" in text
    # The two-shot records are not taken for a fused op against its baselines.
    assert "### two-shot, tp 4" not in text


def test_of_two_runs_on_one_day_the_later_by_its_notes_gives_the_figure(tmp_path: Path) -> None:
    """A folder's name after its date is a commit, which orders nothing: of two runs on one day, the
    one its NOTES.md calls later gives the figure, whichever commit sorts first."""
    results = results_copy(tmp_path)
    header = {"gpu": "Fixture GPU", "tp": 1, "copy_bandwidth_tb_s": 4.0}
    for commit, ordinal, us in (("fffffff", "fourth", 7.0), ("0000000", "fifth", 5.0)):
        folder = results / f"2026-01-04-{commit}"
        folder.mkdir()
        (folder / "NOTES.md").write_text(f"# 2026-01-04 ({ordinal} run): M = 1 once more\n")
        record = {"suite": "model-a", "tp": 1, "m": 1, "variant": "fused OpA (x1)", "us": us, "floor_us": 0.25}
        (folder / "tp1.json").write_text(
            json.dumps({**header, "date": "2026-01-04", "commit": commit, "records": [record]})
        )
    done = page(results=results, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "PAGE.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 1 | ") and "2026-01-04-" in line]
    assert len(rows) == 1 and rows[0].startswith("| 1 | 5.00 (x1) |") and "2026-01-04-0000000 |" in rows[0], rows


def test_plots_are_drawn_for_each_tp(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the page is written without it)")
    done = page(results=FIXTURE, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("ops-tp1.png", "ops-tp2.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"](plots/{name})" in (tmp_path / "PAGE.md").read_text()


def test_without_matplotlib_the_page_is_written_and_says_so(tmp_path: Path) -> None:
    done = page(results=FIXTURE, tmp_path=tmp_path, code=WITHOUT_MATPLOTLIB)
    assert done.returncode == 0, done.stderr
    assert "matplotlib is not installed: the page is written without redrawing its plots" in done.stderr
    text = (tmp_path / "PAGE.md").read_text()
    assert "tp 1: no plot, matplotlib was not installed when the page was made" in text
    assert "| 1 | 3.50 (x1) |" in text
    assert not (tmp_path / "plots").exists()


def test_a_file_without_records_is_refused_by_name(tmp_path: Path) -> None:
    results = results_copy(tmp_path)
    bad = results / "2026-01-02-bbbbbbb" / "notes.json"
    bad.write_text(json.dumps({"date": "2026-01-02", "rows": []}))
    done = page(results=results, tmp_path=tmp_path)
    assert done.returncode != 0
    assert f"{bad}: expected a results file (a header and a 'records' list)" in done.stderr
    missing = page(results=tmp_path / "nowhere", tmp_path=tmp_path)
    assert missing.returncode == 2 and "--results: expected a folder of run folders" in missing.stderr


def test_the_trees_page_is_what_its_results_render(tmp_path: Path) -> None:
    """BENCHMARKS.md is generated: after a new results file, ``python3 -m benchmarks.page`` (this fails
    until it has run)."""
    command = [sys.executable, "-m", "benchmarks.page", "--check"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    stale = tmp_path / "BENCHMARKS.md"
    stale.write_text((ROOT / "BENCHMARKS.md").read_text().replace("| 1 |", "| 2 |", 1))
    done = subprocess.run([*command, "--out", str(stale)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "is stale: run python3 -m benchmarks.page" in done.stderr


class Recorder:
    """Stands in for a nox session: records the commands it would run."""

    def __init__(self) -> None:
        self.posargs = ["--suite", "core"]
        self.commands: list[tuple[str, ...]] = []

    def run(self, *args: str, **options: Any) -> None:
        self.commands.append(args)


def test_nox_bench_regenerates_the_page_after_the_suites() -> None:
    pytest.importorskip("nox", reason="the noxfile imports nox")
    spec = importlib.util.spec_from_file_location("noxfile_for_the_page", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    from nox.registry import get

    session = Recorder()
    get()["bench"](session)
    assert session.commands == [
        ("python3", "-m", "benchmarks.run", "--suite", "core"),
        ("python3", "-m", "benchmarks.page"),
    ]
    alone = Recorder()
    get()["bench_page"](alone)
    assert alone.commands == [("python3", "-m", "benchmarks.page")]
