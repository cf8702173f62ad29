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
        if programs.exchange is None:
            rounds = max(len(publishes), len(collects))
            return [
                self._warmup_round(publishes[i % len(publishes)], collects[i % len(collects)], -1)
                for i in range(rounds)
            ]
        # With a two-shot every route (each protocol's kernels) with every publish, each at M = 1.
        values = collects[0][0]
        return [
            self._warmup_round(publish, (values, route), route)
            for route in range(len(programs.thresholds))
            for publish in publishes
        ]

    def _warmup_round(
        self, publish: tuple[Program, tuple[Any, ...]], collect: tuple[tuple[Any, ...], int], route: int
    ) -> Plan:
        """One round at M = 1: ``publish`` and ``collect`` (values, forced variant); ``route`` >= 0 forces
        the publish's and the exchange's variant too (an op with a two-shot), else they follow M."""
        programs = self._programs
        exchange = programs.exchange

        def run_publish() -> None:
            program, inputs = publish
            self._run(program, inputs, None, variant=route)

        def run_exchange() -> None:
            self._run_exchange(1, route)

        def run_collect(after_publish: bool) -> Any:
            values, variant = collect
            flags = AFTER_PUBLISH_FLAG if after_publish else 0
            program = programs.gather if exchange is not None else programs.collect
            return self._run(program, values, None, collect=values, m=1, flags=flags, variant=variant)

        return Plan(1, run_publish, run_collect, run_exchange if exchange is not None else None)
