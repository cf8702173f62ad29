"""Warm-up: the rounds an op's group drives at construction, so that every publish and every
collective kernel has launched once before any call (none launches first behind a spinning one)."""

from __future__ import annotations

from typing import Any

import torch

from .programs import AFTER_PUBLISH_FLAG, Program
from .two_phase import Plan


class WarmUp:
    """``warmup_rounds`` (a mixin of ``LamportOp``)."""

    def warmup_rounds(self) -> list[Plan]:
        """Rounds that launch every publish and every collective kernel at least once: what the
        op's group drives at construction (every rank's publish, then every rank's collective),
        so that no kernel is launched for the first time behind a spinning one."""
        hidden, device, programs = self.hidden_size, self.device, self._programs
        publishes: list[tuple[Program, tuple[Any, ...]]] = [
            (programs.publish, (torch.zeros(1, hidden, dtype=torch.bfloat16, device=device),))
        ]
        for dtype, program in programs.publish_moe.items():
            moe = (
                torch.zeros(1, hidden, dtype=torch.bfloat16, device=device),
                torch.zeros(1, hidden, dtype=torch.bfloat16, device=device),
                torch.zeros(1, self.top_k, dtype=dtype, device=device),
                torch.full((1, self.top_k), -1, dtype=torch.int32, device=device),
            )
            publishes.append((program, moe))
        collects = list(self._warmup_collects())
        rounds = max(len(publishes), len(collects))

        def launcher(publish: tuple[Program, tuple[Any, ...]], collect: tuple[tuple[Any, ...], int]) -> Plan:
            def run_publish() -> None:
                program, inputs = publish
                self._run(program, inputs, None)

            def run_collect(after_publish: bool) -> Any:
                values, variant = collect
                flags = AFTER_PUBLISH_FLAG if after_publish else 0
                return self._run(programs.collect, values, None, collect=values, m=1, flags=flags, variant=variant)

            return Plan(1, run_publish, run_collect)

        return [launcher(publishes[i % len(publishes)], collects[i % len(collects)]) for i in range(rounds)]
