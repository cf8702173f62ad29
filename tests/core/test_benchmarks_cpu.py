"""The benchmark tools' host side without a GPU: the A/B table and its argument checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def test_host_table_pairs_host_and_wall() -> None:
    from benchmarks.report import host_table
    from benchmarks.suites import Record

    records = [Record("host", 1, 1, "op | host", 10.0, 4.5), Record("host", 1, 1, "op | wall", 11.0, 4.5)]
    assert "| op | 1 | 1 | 10.0 | 11.0 | 4.5 |" in host_table(records)
