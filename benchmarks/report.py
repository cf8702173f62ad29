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
        # At tp > 1 the fused rows also carry the floor with the mailbox traffic (``bench.floors.mailbox_bytes``).
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


def two_shot_table(records) -> str:
    """``--suite two-shot``: per (tp, model) and M, each protocol's time, its floor with the mailbox
    traffic, the two-shot / one-shot ratio; then the crossover measured and the cost model's."""
    from mhc_core.bench.case import cases
    from mhc_core.protocols import NVLINK_H200

    groups = defaultdict(dict)
    for record in records:
        model, protocol = record.variant.rsplit(" ", 1)
        groups[(record.tp, model)].setdefault(record.m, {})[protocol] = record
    lines = []
    for (tp, model), by_m in groups.items():
        lines.append(f"\ntwo-shot, {model}, loopback tp {tp} (median us per call of all ranks, CUDA-graph replays)")
        lines.append("| M | one-shot | two-shot | two / one | one-shot floor w/ mailbox | two-shot floor w/ mailbox |")
        lines.append("|---|---|---|---|---|---|")
        crossover = None
        for m in sorted(by_m):
            one, two = by_m[m].get("one-shot"), by_m[m].get("two-shot")
            if one is None or two is None:
                continue
            if two.us < one.us and crossover is None:
                crossover = m
            elif two.us >= one.us:
                crossover = None
            lines.append(
                f"| {m} | {one.us:.1f} | {two.us:.1f} | {two.us / one.us:.2f} | {one.mailbox_floor_us:.1f} | "
                f"{two.mailbox_floor_us:.1f} |"
            )
        hidden = next((case.hidden for case in cases() if case.key == model), None)
        model_crossover = NVLINK_H200.crossover(tp, hidden) if hidden else None
        lines.append(
            f"crossover measured (loopback, the smallest M from which two-shot stays faster): {crossover}; "
            f"cost model for real tp {tp}: {model_crossover}"
        )
    return "\n".join(lines)


def host_table(records) -> str:
    """The host-overhead suite: one row per call, host (median and best of the rounds) and wall
    microseconds, each host figure beside ``F.rms_norm``'s of the same run, the launch floor."""
    lines = ["\nhost overhead (eager us per call, outputs allocated by the op; interleaved rounds: median, best)"]
    lines.append("| call | tp | M | host us | x F.rms_norm | best host us | x F.rms_norm best | wall us "
                 "| launch floor x launches |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|---|")
    value = {(r.variant, r.tp, r.m): r.us for r in records}
    for r in records:
        if r.variant.endswith(" | host"):
            label = r.variant.rsplit(" | ", 1)[0]
            best = value.get((f"{label} | best", r.tp, r.m), float("nan"))
            wall = value.get((f"{label} | wall", r.tp, r.m), float("nan"))
            norm = value.get(("torch F.rms_norm | host", 1, r.m), float("nan"))
            norm_best = value.get(("torch F.rms_norm | best", 1, r.m), float("nan"))
            lines.append(
                f"| {label} | {r.tp} | {r.m} | {r.us:.1f} | {r.us / norm:.2f} | {best:.1f} | {best / norm_best:.2f} "
                f"| {wall:.1f} | {r.floor_us:.1f} |"
            )
    return "\n".join(lines)


def fp8_table(records) -> str:
    """``--suite fp8`` (``benchmarks.fp8``): per model and format, one row per M: the BF16 op, the fastest
    separate quantisation after it (which), the fused op in FP8-only and both-outputs modes, each with
    its byte floor; what the separate step and the fused one add over the BF16 op; the goal ratios
    (fused addition / (separate addition / 4), <= 1 meets it; at M = 1 also fused addition / 0.3 us).
    Every check that did not find the outputs bit-equal is listed under the table."""
    from .fp8 import BF16_OP, FUSED, FUSED_BOTH, GOAL_ADDED_AT_1_US, GOAL_FRACTION, SEPARATE

    unremarkable = (None, "bit-equal")
    both_floor = "its floor alone adds a third of the separate step's"

    def cell(record) -> str:
        return f"{record.us:.2f} ({record.floor_us:.2f})" if record is not None else ""

    def added(record, base) -> float | None:
        return record.us - base.us if record is not None and base is not None else None

    lines, notes = [], []
    misses: dict[str, list[str]] = {"fp8": [], "both": []}
    by_suite = defaultdict(list)
    for record in records:
        by_suite[(record.suite, record.tp)].append(record)
    for (suite, tp), rows in by_suite.items():
        bf16 = {r.m: r for r in rows if r.variant == BF16_OP}
        formats = list(dict.fromkeys(r.variant.split(" | ")[0] for r in rows if " | " in r.variant))
        lines.append(f"\n{suite}, tp {tp} (median us per call, CUDA-graph replays; byte floor in parentheses)")
        lines.append(
            "| format | M | bf16 op | best separate: bf16 op + | fused fp8 | fused fp8 + bf16 | separate adds "
            f"| fused adds: fp8 / both | goal: fused / (separate x {GOAL_FRACTION}), fp8 / both |"
        )
        lines.append("|" + "---|" * 9)
        for name in formats:
            for m in sorted({r.m for r in rows}):
                at = {r.variant.split(" | ", 1)[1]: r for r in rows if r.m == m and r.variant.startswith(f"{name} | ")}
                base = bf16.get(m)
                separates = [r for key, r in at.items() if key.startswith(SEPARATE)]
                best = min(separates, key=lambda r: r.us) if separates else None
                fused, both = at.get(FUSED), at.get(FUSED_BOTH)
                separate_add = added(best, base)
                fused_adds = [added(fused, base), added(both, base)]
                ratios = []
                for mode, add in zip(("fp8", "both"), fused_adds, strict=True):
                    if add is None or separate_add is None or separate_add <= 0:
                        ratios.append("")
                        continue
                    ratio = add / (separate_add * GOAL_FRACTION)
                    text = f"{ratio:.2f}"
                    if m == 1:
                        text += f" ({add / GOAL_ADDED_AT_1_US:.2f} of {GOAL_ADDED_AT_1_US} us)"
                    if ratio > 1 or (m == 1 and add > GOAL_ADDED_AT_1_US):
                        misses[mode].append(f"{suite} {name} M = {m}")
                    ratios.append(text)
                which = f"{best.variant.split(SEPARATE, 1)[1]} " if best is not None else ""
                lines.append(
                    f"| {name} | {m} | {cell(base)} | {which}{cell(best)} | {cell(fused)} | {cell(both)} | "
                    + (f"{separate_add:.2f}" if separate_add is not None else "")
                    + " | "
                    + " / ".join(f"{add:.2f}" if add is not None else "-" for add in fused_adds)
                    + f" | {' / '.join(ratio or '-' for ratio in ratios)} |"
                )
                notes += [f"{suite} {r.variant} M = {m}: {r.note}" for r in at.values() if r.note not in unremarkable]
    for mode, what in (("fp8", "FP8 only"), ("both", f"both outputs ({both_floor})")):
        missed = misses[mode]
        lines.append(f"goal, {what}: " + (f"missed at {'; '.join(missed)}" if missed else "met at every M and format"))
    lines += ["not bit-equal (figures kept):", *[f"  {note}" for note in notes]] if notes else ["every check bit-equal"]
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
        if suite == "host" or suite.startswith("fp8-"):  # one M / a floor per variant: the table says it all
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
