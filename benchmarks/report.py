"""Tables and plots of benchmark records."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def table(records) -> str:
    """One row per M: every variant's median microseconds, the byte floor, fused ratios."""
    if not records:
        return ""
    by_suite = defaultdict(list)
    for record in records:
        by_suite[(record.suite, record.tp)].append(record)
    lines = []
    for (suite, tp), rows in by_suite.items():
        variants = list(dict.fromkeys(r.variant for r in rows))
        fused = next((v for v in variants if v.startswith(("fused", "lamport"))), None)
        # At tp > 1 the fused rows also carry the floor with the mailbox traffic (``suites.mailbox_bytes``).
        second = any(getattr(r, "mailbox_floor_us", None) is not None for r in rows)
        extra = " floor with mailbox | fused / that |" if second else ""
        lines.append(f"\n{suite}, tp {tp} (median us per call, CUDA-graph replays)")
        lines.append("| M | " + " | ".join(variants) + " | byte floor | fused / floor |" + extra)
        lines.append("|" + "---|" * (len(variants) + 3 + 2 * second))
        for m in sorted({r.m for r in rows}):
            at_m = {r.variant: r for r in rows if r.m == m}
            floor = next(iter(at_m.values())).floor_us
            cells = [f"{at_m[v].us:.1f}" if v in at_m else "" for v in variants]
            ratio = f"{at_m[fused].us / floor:.2f}" if fused in at_m else ""
            line = f"| {m} | " + " | ".join(cells) + f" | {floor:.1f} | {ratio} |"
            if second:
                mailbox = getattr(at_m.get(fused), "mailbox_floor_us", None)
                line += f" {mailbox:.1f} | {at_m[fused].us / mailbox:.2f} |" if mailbox else "  |  |"
            lines.append(line)
    return "\n".join(lines)


def host_table(records) -> str:
    """The host-overhead suite: one row per call, host and wall microseconds, the launch floor."""
    lines = ["\nhost overhead (eager us per call, outputs allocated by the op)"]
    lines.append("| call | tp | M | host us | wall us | launch floor x launches |")
    lines.append("|---|---|---|---|---|---|")
    walls = {(r.variant.rsplit(" | ", 1)[0], r.tp, r.m): r.us for r in records if r.variant.endswith(" | wall")}
    for r in records:
        if r.variant.endswith(" | host"):
            label = r.variant.rsplit(" | ", 1)[0]
            wall = walls.get((label, r.tp, r.m), float("nan"))
            lines.append(f"| {label} | {r.tp} | {r.m} | {r.us:.1f} | {wall:.1f} | {r.floor_us:.1f} |")
    return "\n".join(lines)


def overlap_table(records) -> str:
    """The glm5-overlap suite (``benchmarks.overlap``): (a)-(d) per M, beside (a) + (b), what (d)
    should take, and (d) - (c), the microseconds the GEMM hid of the side-stream mixes."""
    lines = ["\nglm5-overlap (median us per call of the compiled function, CUDA-graph replays)"]
    lines.append("| tp | M | (a) boundary + join | (b) gemm | (a) + (b) | (c) boundary, gemm, join "
                 "| (d) boundary, join, gemm | hidden: (d) - (c) |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|")
    times = {(r.tp, r.m, r.variant[:3]): r.us for r in records}
    for tp, m in sorted({(r.tp, r.m) for r in records}):
        a, b, c, d = (times.get((tp, m, key), float("nan")) for key in ("(a)", "(b)", "(c)", "(d)"))
        lines.append(f"| {tp} | {m} | {a:.2f} | {b:.2f} | {a + b:.2f} | {c:.2f} | {d:.2f} | {d - c:.2f} |")
    return "\n".join(lines)


def plots(records, folder: Path, stem: str, header: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plots", flush=True)
        return
    by_suite = defaultdict(list)
    for record in records:
        by_suite[record.suite].append(record)
    for suite, rows in by_suite.items():
        if suite == "host":  # eager host times at one M: the table says it all
            continue
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for variant in dict.fromkeys(r.variant for r in rows):
            points = sorted((r.m, r.us) for r in rows if r.variant == variant)
            axis.plot(*zip(*points, strict=True), marker="o", label=variant)
        floors = sorted({(r.m, r.floor_us) for r in rows})
        axis.plot(*zip(*floors, strict=True), linestyle="--", color="black", label="HBM byte floor")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tokens M")
        axis.set_ylabel("us per call (median, CUDA graph)")
        axis.set_title(f"{suite}, tp {header['tp']}: {header['gpu'].split(' (')[0]}, {header['date']}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(folder / f"{stem}_{suite}.png", dpi=110)
        plt.close(figure)
