"""The "Latest figures" page (BENCHMARKS.md) and its plots, rendered from the results files.

    python3 -m benchmarks.page              # rewrite BENCHMARKS.md and benchmarks/plots/*.png
    python3 -m benchmarks.page --check      # exit 1 if BENCHMARKS.md is not what the results render
    python3 -m benchmarks.page --results DIR --out FILE --plots DIR

``nox -s bench`` runs it after the suites, ``nox -s bench_page`` alone (no GPU needed).

What feeds it: every run folder under ``benchmarks/results/`` named ``<date>-<commit>`` (a commit of
main) and the JSON files in it as ``benchmarks.run`` writes them (a header and records). Repeats of
one figure in one folder (``fp8-...-run1.json``, ``-run2``) count as their median; across folders
the latest (by date, then folder name) gives each figure, so a run that measured a few M leaves the
others to older runs, and every row names the folder it came from. Folders of another name (an
unmerged branch's A/B) feed no figure. Every folder's ``NOTES.md`` (what the run did, in words) is
listed under "History", and ``benchmarks/summary.md`` / ``benchmarks/method.md`` are copied in as
written. The plots need matplotlib (not a dependency): without it the page is still written,
pointing at the plots already in the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from .checkout import ROOT, add_packages

RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
PLOTS = ROOT / "benchmarks" / "plots"
SUMMARY = ROOT / "benchmarks" / "summary.md"
METHOD = ROOT / "benchmarks" / "method.md"
#: A folder that feeds the page: ``<date>-<commit of main>``.
RUN_FOLDER = re.compile(r"^(\d{4}-\d{2}-\d{2})-([0-9a-f]{7,40})$")
NO_MATPLOTLIB = "matplotlib is not installed: the page is written without redrawing its plots (pip install matplotlib)"
#: Suites with tables of their own (``benchmarks.report``); any other suite is a fused op's against its baselines.
SPECIAL = ("host", "spin-bound", "two-shot")
FUSED_PREFIXES = ("fused", "lamport")
#: A fused variant's kernel tag, e.g. " (x8)": tokens per cluster, one line for the op whatever the tag.
TAG = re.compile(r"^(?P<name>.*?)(?: \((?P<tag>x\d+)\))?$")
ORDINALS = (
    {
        word: index
        for index, word in enumerate(
            ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"), start=1
        )
    }
    | {
        word: index
        for index, word in enumerate(
            ("eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth", "eighteenth"),
            start=11,
        )
    }
    | {"nineteenth": 19, "twentieth": 20}
)


@dataclass
class Run:
    """One results file: its folder, header and records (each record a namespace, as the report tables read)."""

    folder: str
    name: str
    header: dict
    records: list = field(default_factory=list)
    #: The run's place in its day: its NOTES.md's ordinal ("twenty-sixth run" -> 26), else after them.
    run_of_day: float = 99

    @property
    def order(self) -> tuple[str, float, str]:
        # A folder's name after its date is a commit: it orders nothing, the run's ordinal does.
        return (self.header.get("date", ""), self.run_of_day, self.folder)


def kind(suite: str) -> str:
    if suite.startswith("fp8-"):
        return "fp8"
    return suite if suite in SPECIAL else "ops"


def load(results: Path) -> list[Run]:
    """Every results file of every ``<date>-<commit>`` folder, oldest first. A file that is not a
    results file (no ``records`` list) is refused by name rather than skipped."""
    runs = []
    for folder in sorted(path for path in results.iterdir() if path.is_dir() and RUN_FOLDER.match(path.name)):
        run_of_day = notes_title(folder / "NOTES.md")[1]
        for path in sorted(folder.glob("*.json")):
            payload = json.loads(path.read_text())
            if not isinstance(payload, dict) or not isinstance(payload.get("records"), list):
                raise ValueError(f"{path}: expected a results file (a header and a 'records' list), got no records")
            header = {key: value for key, value in payload.items() if key != "records"}
            defaults = {"mailbox_floor_us": None, "note": None}
            records = [SimpleNamespace(**{**defaults, **record}) for record in payload["records"]]
            runs.append(Run(folder.name, path.name, header, records, run_of_day))
    return sorted(runs, key=lambda run: run.order)


def latest(runs: list[Run], wanted: str) -> list:
    """The figures of one kind: per (suite, tp, M, variant) the latest folder's, the median of its repeats.
    ``runs`` come oldest first (``load``)."""
    by_folder: dict[str, dict[tuple, list]] = {}
    for run in runs:
        for record in run.records:
            if kind(record.suite) == wanted:
                key = (record.suite, record.tp, record.m, record.variant)
                by_folder.setdefault(run.folder, defaultdict(list))[key].append((record, run))
    chosen: dict[tuple, SimpleNamespace] = {}
    for folder, figures in by_folder.items():  # oldest first: a later folder overwrites
        for key, found in figures.items():
            first, run = found[0]
            values = {}
            for name in ("us", "floor_us", "mailbox_floor_us"):
                numbers = [getattr(record, name) for record, _ in found if getattr(record, name) is not None]
                values[name] = statistics.median(numbers) if numbers else None
            chosen[key] = SimpleNamespace(
                **{**vars(first), **values}, source=folder, repeats=len(found), header=run.header
            )
    return list(chosen.values())


def relative(path: Path, page: Path) -> str:
    return Path(os.path.relpath(path, page.parent)).as_posix()


def sources(records, results: Path, page: Path) -> str:
    folders = sorted({record.source for record in records})
    headers = {record.source: record.header for record in records}
    return "; ".join(
        f"[`{folder}`]({relative(results / folder, page)}) ({headers[folder].get('gpu', 'GPU not recorded')}, "
        f"copy {headers[folder].get('copy_bandwidth_tb_s', float('nan')):.2f} TB/s)"
        for folder in folders
    )


def fused_name(variant: str) -> tuple[str, str]:
    match = TAG.match(variant)
    return match.group("name"), match.group("tag") or ""


def ops_tables(records) -> list[tuple[tuple[int, str], str]]:
    """Per (tp, suite): M, the fused op (its kernel tag), its floors and ratios, every baseline, the
    best baseline over the fused op, and the folder of the row."""
    groups = defaultdict(list)
    for record in records:
        groups[(record.tp, record.suite)].append(record)
    out = []
    for (tp, suite), rows in sorted(groups.items()):
        baselines = list(dict.fromkeys(r.variant for r in rows if not r.variant.startswith(FUSED_PREFIXES)))
        fused_rows = [r for r in rows if r.variant.startswith(FUSED_PREFIXES)]
        fused = list(dict.fromkeys(fused_name(r.variant)[0] for r in fused_rows))
        mailbox = any(r.mailbox_floor_us is not None for r in fused_rows)
        head = ["M", *(f"{name} (µs)" for name in fused), "byte floor", "fused / floor"]
        head += ["floor w/ mailbox", "fused / that"] if mailbox else []
        head += [*baselines, "best baseline / fused", "run"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in sorted({r.m for r in rows}):
            at = [r for r in rows if r.m == m]
            by_name = {fused_name(r.variant)[0]: r for r in at if r.variant.startswith(FUSED_PREFIXES)}
            base = {r.variant: r for r in at if r.variant in baselines}
            main = next(iter(by_name.values()), None)
            floor = at[0].floor_us
            cells = [str(m)]
            for name in fused:
                record = by_name.get(name)
                tag = fused_name(record.variant)[1] if record else ""
                cells.append(f"{record.us:.2f}" + (f" ({tag})" if tag else "") if record else "")
            cells += [f"{floor:.2f}", f"{main.us / floor:.1f}" if main else ""]
            if mailbox:
                second = main.mailbox_floor_us if main else None
                cells += [f"{second:.2f}", f"{main.us / second:.1f}"] if second else ["", ""]
            cells += [f"{base[name].us:.1f}" if name in base else "" for name in baselines]
            best = min(base.values(), key=lambda r: r.us) if base else None
            cells.append(f"{best.us / main.us:.1f}" if best and main else "")
            cells.append(", ".join(sorted({r.source for r in at})))
            lines.append("| " + " | ".join(cells) + " |")
        out.append(((tp, suite), "\n".join(lines)))
    return out


def plot_names(records, prefix: str) -> dict[int, str]:
    return {tp: f"{prefix}-tp{tp}.png" for tp in sorted({r.tp for r in records})}


def draw(records, folder: Path, prefix: str, series) -> bool:
    """One PNG per tp, one panel per suite (two-shot: per model); ``series(rows)`` gives the lines.
    False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    for tp, name in plot_names(records, prefix).items():
        panels = defaultdict(list)
        for record in records:
            if record.tp == tp:
                panels[panel_key(record)].append(record)
        figure, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
        for axis, (title, rows) in zip(axes[0], sorted(panels.items()), strict=True):
            for label, points, style in series(rows):
                axis.plot(*zip(*sorted(points), strict=True), label=label, **style)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_xlabel("tokens M")
            axis.set_ylabel("µs per call (median, CUDA graph)")
            when = ", ".join(sorted({r.source for r in rows}))
            axis.set_title(f"{title}, tp {tp} ({when})", fontsize=9)
            axis.grid(True, which="both", alpha=0.3)
            axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / name, dpi=100, metadata={"Software": None})
        plt.close(figure)
    return True


def panel_key(record) -> str:
    return record.variant.rsplit(" ", 1)[0] if record.suite == "two-shot" else record.suite


def ops_series(rows):
    lines = defaultdict(list)
    for record in rows:
        name = fused_name(record.variant)[0] if record.variant.startswith(FUSED_PREFIXES) else record.variant
        lines[name].append((record.m, record.us))
    for name, points in lines.items():
        yield name, points, {"marker": "o", "linewidth": 2.2 if name.startswith(FUSED_PREFIXES) else 1.2}
    yield "HBM byte floor", sorted({(r.m, r.floor_us) for r in rows}), {"linestyle": "--", "color": "black"}
    mailbox = sorted({(r.m, r.mailbox_floor_us) for r in rows if r.mailbox_floor_us is not None})
    if mailbox:
        yield "floor with the mailbox traffic", mailbox, {"linestyle": ":", "color": "black"}


def two_shot_series(rows):
    for protocol in ("one-shot", "two-shot"):
        mine = [r for r in rows if r.variant.endswith(" " + protocol)]
        if mine:
            yield protocol, [(r.m, r.us) for r in mine], {"marker": "o"}
            floors = [(r.m, r.mailbox_floor_us) for r in mine if r.mailbox_floor_us is not None]
            if floors:
                yield f"{protocol} floor w/ mailbox", floors, {"linestyle": ":"}


def ordinal(label: str) -> float:
    """ "twenty-third run" -> 23; a label without a run's ordinal ("no GPU") sorts after its day's runs."""
    match = re.match(r"(?:(twenty)-)?([a-z]+) run", label)
    if not match or match.group(2) not in ORDINALS:
        return 99
    return ORDINALS[match.group(2)] + (20 if match.group(1) else 0)


def notes_title(notes: Path) -> tuple[str, float, str, str]:
    """(date, ordinal, run label, what it measured) from a NOTES.md's first line, e.g. "2026-12-07
    (twenty-sixth run) — ..."; a folder without notes sorts after its day's runs."""
    if not notes.is_file():
        return "", 99, "", ""
    title = notes.read_text().splitlines()[0].lstrip("# ").strip()
    match = re.match(r"(\d{4}-\d{2}-\d{2}) \((.+?)\)[:,]?\s*(?:— )?(.*)", title)
    date, label, what = match.groups() if match else ("", "", title)
    return date, ordinal(label), label, what


def history(results: Path, page: Path) -> str:
    """Every folder's NOTES.md, newest first: run, date, what it measured (its first line)."""
    entries = []
    for notes in results.glob("*/NOTES.md"):
        date, run_of_day, label, what = notes_title(notes)
        entries.append(((date, run_of_day, notes.parent.name), label, what, notes))
    lines = ["| date | run | what | notes |", "|---|---|---|---|"]
    for (date, _, folder), label, what, notes in sorted(entries, reverse=True):
        lines.append(f"| {date} | {label} | {what} | [`{folder}/NOTES.md`]({relative(notes, page)}) |")
    return "\n".join(lines)


def blocks(text: str) -> str:
    """A report table's text as markdown: each table one block, each other line a paragraph of its own."""
    lines: list[str] = []
    for line in text.strip("\n").splitlines():
        if lines and not (line.startswith("|") and lines[-1].startswith("|")):
            lines.append("")
        lines.append(line)
    return "\n".join(lines)


def embed(path: Path) -> str:
    """A hand-written part, its own top heading dropped (the page gives it one)."""
    if not path.exists():
        return f"(`{path.name}` not found)"
    return re.sub(r"\A#+ [^\n]*\n+", "", path.read_text()).strip()


def render(results: Path, page: Path, plots: Path, draw_plots: bool = True) -> str:
    """The page's text; with ``draw_plots`` also its PNGs (if matplotlib is importable)."""
    runs = load(results)
    ops, fp8, host, spin, two = (latest(runs, name) for name in ("ops", "fp8", "host", "spin-bound", "two-shot"))
    drew = None
    if draw_plots:
        drew = draw(ops, plots, "ops", ops_series) & (not two or draw(two, plots, "two-shot", two_shot_series))
        if not drew:
            print(NO_MATPLOTLIB, file=sys.stderr, flush=True)
    out = [
        "# Benchmarks: latest figures",
        "",
        "<!-- Generated by `python3 -m benchmarks.page` (`nox -s bench`, `nox -s bench_page`) from the results "
        "files under benchmarks/results/: do not edit. Edit benchmarks/summary.md, benchmarks/method.md or a "
        "run's NOTES.md, then run it again. -->",
        "",
        "Generated by `python3 -m benchmarks.page` (run by `nox -s bench`; `nox -s bench_page` alone) from the "
        f"results files under [`benchmarks/results/`]({relative(results, page)}): per figure, the latest "
        "`<date>-<commit>` folder that measured it (repeats in one folder: their median), the folder named in "
        "each row. Median µs per call, CUDA-graph replays. Plain PyTorch baselines, byte floors and the rest "
        'of the method: "Method" below; every run\'s own notes: "History".',
        "",
        "## Plots",
        "",
    ]
    for prefix, records, what in (
        ("ops", ops, "the fused ops against their baselines and byte floors"),
        ("two-shot", two, "the one-shot against the two-shot protocol"),
    ):
        for tp, name in plot_names(records, prefix).items():
            if (plots / name).exists():
                out += [f"![{what}, tp {tp}]({relative(plots / name, page)})", ""]
            else:
                out += [f"({what}, tp {tp}: no plot, matplotlib was not installed when the page was made)", ""]
    summary = f"Hand-written with each run ([`benchmarks/summary.md`]({relative(SUMMARY, page)}))."
    out += ["## In words", "", summary, "", embed(SUMMARY), ""]
    out += ["## Tables", ""]
    for (tp, suite), text in ops_tables(ops):
        out += [
            f"### {suite}, tp {tp}",
            "",
            f"From {sources([r for r in ops if r.tp == tp and r.suite == suite], results, page)}.",
            "",
            text,
            "",
        ]
    add_packages()
    from . import report

    for title, records, table in (
        ("FP8 layer input (`--suite fp8`)", fp8, report.fp8_table),
        ("Host overhead (`--suite host`)", host, report.host_table),
        ("Spin bound (`--suite spin-bound`)", spin, report.table),
        ("All-reduce protocols: one-shot and two-shot (`--suite two-shot`)", two, report.two_shot_table),
    ):
        if records:
            text = blocks(table(sorted(records, key=lambda r: (r.suite, r.tp, r.m))))
            out += [f"### {title}", "", f"From {sources(records, results, page)}.", "", text, ""]
    out += ["## Method", "", embed(METHOD), "", "## History", "", history(results, page), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of <date>-<commit> run folders")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    parser.add_argument("--plots", type=Path, default=PLOTS, help="folder of the page's PNG plots")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is stale")
    options = parser.parse_args(argv)
    if not options.results.is_dir():
        parser.error(f"--results: expected a folder of run folders, got {options.results} (not a folder)")
    text = render(options.results, options.out, options.plots, draw_plots=not options.check)
    if options.check:
        if not options.out.exists() or options.out.read_text() != text:
            print(f"{options.out} is stale: run python3 -m benchmarks.page", file=sys.stderr)
            return 1
        return 0
    options.out.write_text(text)
    print(f"wrote {options.out} and the plots in {options.plots}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
