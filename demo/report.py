"""The demo's figures: one ``Row`` per (stack, M), the table, the JSON and the PNG plot.

Integration efficiency = step-time saving / (boundaries per step x per-boundary saving), the
per-boundary saving measured in isolation in the same run with the same ops: the mean of the
attention boundary's (plain input) and the MoE boundary's (finalize form), since a step has as
many of each. 1 means the model keeps every microsecond the ops save alone; GLM can exceed 1
(its side-stream mixes are on the critical path in isolation, not in the model).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: Issue #19's goal at M = 1 and 8, tp 1.
GOAL = 0.9


@dataclass
class Row:
    model: str
    tp: int
    m: int
    layers: int
    unfused_us: float  # per decode step (router included), median of CUDA-graph replays
    fused_us: float
    isolated_us: dict[str, float]  # "attention unfused", "attention fused", "moe unfused", "moe fused"
    steps: list[dict] = field(default_factory=list)  # demo.check.StepResult.as_dict() per decode step
    #: ``--diagnose``: the unfused path with each boundary behind an opaque custom op (``demo.opaque``).
    opaque_us: float | None = None

    @property
    def boundaries(self) -> int:
        return 2 * self.layers

    def tokens_per_s(self, us: float) -> float:
        return self.m * 1e6 / us

    @property
    def per_boundary_saving_us(self) -> float:
        iso = self.isolated_us
        saving = (iso["attention unfused"] - iso["attention fused"]) + (iso["moe unfused"] - iso["moe fused"])
        return saving / 2

    @property
    def step_saving_us(self) -> float:
        return self.unfused_us - self.fused_us

    @property
    def expected_saving_us(self) -> float:
        """What the step would save if it kept every boundary's isolated saving."""
        return self.boundaries * self.per_boundary_saving_us

    @property
    def efficiency(self) -> float:
        expected = self.expected_saving_us
        return self.step_saving_us / expected if expected > 0 else float("nan")

    @property
    def efficiency_opaque(self) -> float:
        """The efficiency against the opaque unfused path (``--diagnose``; NaN without it)."""
        expected = self.expected_saving_us
        if self.opaque_us is None or expected <= 0:
            return float("nan")
        return (self.opaque_us - self.fused_us) / expected

    @property
    def check_passed(self) -> bool:
        return bool(self.steps) and all(step["passed"] for step in self.steps)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "boundaries": self.boundaries,
            "per_boundary_saving_us": self.per_boundary_saving_us,
            "step_saving_us": self.step_saving_us,
            "efficiency": self.efficiency,
            "efficiency_opaque": self.efficiency_opaque,
            "check_passed": self.check_passed,
        }


def check_summary(row: Row) -> str:
    if not row.steps:
        return "not run"
    logit = max(step["logit_ratio"] for step in row.steps)
    kernel = max(step["conformance"] for step in row.steps)
    verdict = "pass" if row.check_passed else "FAIL"
    # Four decimals: a boundary output at 0.9999 of its bound is a BF16 rounding tie (the kernel and
    # the reference round nearly equal values to neighbouring BF16 numbers; the bound allows that
    # one ulp), which two decimals print as 1.00.
    return f"{verdict} ({len(row.steps)} steps; logits {logit:.2f}, boundaries {kernel:.4f} of tolerance)"


def table(rows: Sequence[Row]) -> str:
    lines = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        first = mine[0]
        lines.append(
            f"\n{model}, tp {first.tp}, {first.layers} layers: {first.boundaries} boundaries per step "
            "(median us per decode step, CUDA-graph replays)"
        )
        lines.append(
            "| M | unfused us | fused us | unfused tok/s | fused tok/s | boundaries | saving / boundary us "
            "(attention, MoE) | step saving us | efficiency | logit check |"
        )
        lines.append("|" + "---|" * 10)
        for r in mine:
            iso = r.isolated_us
            kinds = (
                f"{iso['attention unfused'] - iso['attention fused']:.2f}, {iso['moe unfused'] - iso['moe fused']:.2f}"
            )
            lines.append(
                f"| {r.m} | {r.unfused_us:.1f} | {r.fused_us:.1f} | {r.tokens_per_s(r.unfused_us):.0f} | "
                f"{r.tokens_per_s(r.fused_us):.0f} | {r.boundaries} | {r.per_boundary_saving_us:.2f} ({kinds}) | "
                f"{r.step_saving_us:.1f} | {r.efficiency:.2f} | {check_summary(r)} |"
            )
        diagnosed = [r for r in mine if r.opaque_us is not None]
        if diagnosed:
            lines.append(
                "\nwhere the saving goes (--diagnose): the unfused path with each boundary behind an opaque custom "
                "op, as the fused op is"
            )
            lines.append(
                "| M | unfused us | unfused, opaque boundaries us | fused us | inductor's fusion across "
                "boundaries us | efficiency | efficiency against the opaque path |"
            )
            lines.append("|" + "---|" * 7)
            for r in diagnosed:
                assert r.opaque_us is not None
                lines.append(
                    f"| {r.m} | {r.unfused_us:.1f} | {r.opaque_us:.1f} | {r.fused_us:.1f} | "
                    f"{r.opaque_us - r.unfused_us:.1f} | {r.efficiency:.2f} | {r.efficiency_opaque:.2f} |"
                )
    return "\n".join(lines)


def write_json(rows: Sequence[Row], path: Path, header: dict) -> None:
    path.write_text(json.dumps({**header, "rows": [r.as_dict() for r in rows]}, indent=1))


def plot(rows: Sequence[Row], path: Path, header: dict) -> bool:
    """Per stack: step latency of both paths against M, and the integration efficiency. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r.model for r in rows))
    figure, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7.5), squeeze=False)
    for column, model in enumerate(models):
        mine = sorted((r for r in rows if r.model == model), key=lambda r: r.m)
        ms = [r.m for r in mine]
        latency, efficiency = axes[0][column], axes[1][column]
        latency.plot(ms, [r.unfused_us for r in mine], marker="o", label="unfused (all-reduce + torch boundary)")
        latency.plot(ms, [r.fused_us for r in mine], marker="o", label="fused (torch.ops.mhc)")
        latency.set_xscale("log", base=2)
        latency.set_ylabel("us per decode step (median, CUDA graph)")
        latency.set_title(f"{model}, tp {mine[0].tp}, {mine[0].boundaries} boundaries per step")
        latency.grid(True, which="both", alpha=0.3)
        latency.legend(fontsize=7)
        efficiency.bar([str(m) for m in ms], [r.efficiency for r in mine], color="tab:green")
        efficiency.axhline(GOAL, linestyle="--", color="black", label=f"goal {GOAL}")
        efficiency.set_xlabel("tokens M")
        efficiency.set_ylabel("step saving / (boundaries x isolated saving)")
        efficiency.grid(True, axis="y", alpha=0.3)
        efficiency.legend(fontsize=7)
    figure.suptitle(f"demo decoder: {header.get('gpu', '').split(' (')[0]}, {header.get('date', '')}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
