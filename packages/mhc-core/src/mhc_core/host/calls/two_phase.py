"""The two-phase form: ``publish`` / ``collect``, and ``plan`` (one call validated, split into its
launches, for a driver that interleaves ranks: ``run_ranks``). A pending publish is not held
across threads: until its collect, every other call of the op raises.

With a two-shot (``mhc_core.protocols``), ``collect`` runs the reduce, then the boundary: ranks that
run at once (processes) need nothing more. A driver of ranks that run one after another (loopback)
needs three phases, each over every rank: a plan's ``exchange`` runs the reduce alone, and its
``collect`` then the boundary alone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...protocols import TWO_SHOT
from .moe import MOE_FIELDS, MoEOutput
from .programs import AFTER_PUBLISH_FLAG


@dataclass
class Plan:
    """One validated call, split into its two launches (nothing launched yet)."""

    m: int
    publish: Callable[[], None]
    collect: Callable[[bool], Any]
    #: The two-shot's middle phase (every rank's, after every publish); None: the op has no two-shot.
    exchange: Callable[[], None] | None = None


class TwoPhaseCalls:
    """``publish``, ``collect`` and ``plan`` (a mixin of ``LamportOp``)."""

    #: The pending publish's M, or None (set by ``LamportOp.__init__``; declared for type checkers).
    _pending_m: int | None
    #: Whether the pending publish's two-shot reduce has run (a loopback rank's, ``exchange_pending``).
    _exchanged: bool = False

    def publish(self, x: torch.Tensor | MoEOutput) -> None:
        """Phase one: publish this rank's partial (or MoE output) for the next ``collect``. Until
        that collect (from any thread), every other call of the op raises."""
        with self._lock:
            self._check_usable()
            if self._pending_m is not None:
                raise RuntimeError("publish(): a previous publish() has not been collected yet; call collect() first")
            programs = self._programs
            program, values = self._publish_input(x, programs.publish_moe, programs.publish)
            rules = programs.moe_rules[: len(MOE_FIELDS)] if isinstance(x, MoEOutput) else None
            self._in_launch = False
            capture = self._order.begin()
            try:
                self._exchanged = False
                self._pending_m = int(self._run(program, values, None, capture=capture, rules=rules))
            except BaseException as error:
                self._call_failed(error)
                raise

    def _collect_pending(self, values: tuple[Any, ...], out: Any, after_publish: bool) -> Any:
        """Validate and launch the collective for the pending publish's M."""
        if self.group.kind == "loopback":
            # Loopback ranks run one after another: this rank's boundary needs every rank's reduce,
            # so the first two-shot collect runs them all (after every rank's publish), holding every
            # rank's lock in the process-wide order: before this op's own, never under it.
            self.group.exchange_pending(self)
        with self._lock:
            self._check_usable()
            if self._pending_m is None:
                raise RuntimeError("collect(): no publish() is pending; the collective would wait forever")
            flags = AFTER_PUBLISH_FLAG if after_publish else 0
            program = self._programs.collect
            if self._loopback_two_shot(self._pending_m):
                if not self._exchanged:  # a publish() on this rank from another thread, in between
                    raise RuntimeError(
                        "collect(): this rank published again while its loopback two-shot collect ran "
                        "every rank's reduce; call publish() and collect() of one rank from one thread"
                    )
                program = self._programs.gather
            self._in_launch = False
            try:
                outputs = self._run(
                    program, values, out, collect=values, m=self._pending_m, flags=flags, capture=self._order.capture
                )
                self._exchanged = False
                self._pending_m = None  # only now: a rejected collect leaves the publish pending, to collect again
                self._order.end()
            except BaseException as error:
                self._call_failed(error)
                raise
            return self._returns(outputs)

    def plan(self, method: str, *args: Any, **kwargs: Any) -> Plan:
        """Validate one ``method`` call ("call" or "finalize") without launching anything: its
        publish and its collect, launched by the returned plan (``run_ranks``)."""
        if method not in ("call", "finalize"):
            raise ValueError(f"method: expected 'call' or 'finalize', got {method!r}")
        with self._lock:
            self._check_usable()
            self._require_no_publish(method)
            x, values, out = self._plan_values(method, *args, **kwargs)
            programs = self._programs
            if self.tp == 1 and self.reads_x and type(x) is torch.Tensor:  # the direct path: one launch
                m = self._check(programs.call, (x, *values), out)
                return self._plan(m, None, dict(program=programs.call, values=(x, *values), like=x, m=-1), values, out)
            moe_rules = programs.moe_rules[: len(MOE_FIELDS)] if isinstance(x, MoEOutput) else None
            publish, inputs = self._publish_input(x, programs.publish_moe, programs.publish)
            m = self._check(publish, inputs, None, rules=moe_rules)
            collect = programs.gather or programs.collect  # with a two-shot, the reduce is the exchange's
            self._check(collect, values, out, m=m)
            return self._plan(m, (publish, inputs), dict(program=collect, values=values, m=m), values, out)

    def _loopback_two_shot(self, m: int) -> bool:
        return self.group.kind == "loopback" and self.protocols.protocol(m) == TWO_SHOT

    def _require_no_publish(self, what: str) -> None:
        if self._pending_m is not None:
            raise RuntimeError(f"{what}: a publish() is pending; call collect() first")

    def _plan(
        self, m: int, publish: tuple[Any, ...] | None, collect: dict[str, Any], values: tuple[Any, ...], out: Any
    ) -> Plan:
        """The plan's two launches. Each holds the op's lock; in between, the publish is pending (the
        op's other calls raise), as after ``publish()``. The direct path launches only in its collect."""

        def run_publish() -> None:
            if publish is None:
                return
            program, inputs = publish
            with self._lock:
                self._ensure_usable()
                self._require_no_publish("plan publish")
                self._in_launch = False
                capture = self._order.begin()
                try:
                    self._exchanged = False
                    self._run(program, inputs, None, capture=capture)
                    self._pending_m = m
                except BaseException as error:
                    self._call_failed(error)
                    raise

        def run_collect(after_publish: bool) -> Any:
            flags = AFTER_PUBLISH_FLAG if after_publish else 0
            with self._lock:
                self._ensure_usable()
                self._in_launch = False
                if publish is None:  # the direct path: this is the call's one launch
                    self._require_no_publish("plan collect")
                    self._order.begin()
                elif self._pending_m != m:
                    raise RuntimeError("plan collect: its publish is not pending (not run, or collected already)")
                try:
                    outputs = self._run(
                        collect["program"], collect["values"], out, like=collect.get("like"), collect=values,
                        m=collect["m"], flags=flags, capture=self._order.capture,
                    )  # fmt: skip
                    self._pending_m = None
                    self._order.end()
                except BaseException as error:
                    self._call_failed(error)
                    raise
                return self._returns(outputs)

        def run_exchange() -> None:
            with self._lock:
                self._ensure_usable()
                if self._pending_m != m:
                    raise RuntimeError("plan exchange: its publish is not pending (not run, or collected already)")
                self._run_exchange(m)

        exchange = run_exchange if publish is not None and self._programs.exchange is not None else None
        return Plan(m, run_publish, run_collect, exchange)

    def _run_exchange(self, m: int, variant: int = -1) -> None:
        """The two-shot's reduce alone, for M tokens (nothing launches for a one-shot M)."""
        assert self.mailbox is not None and self._programs.exchange is not None
        self._exchanged = True
        self._in_launch = False
        try:
            self._run(self._programs.exchange, (self.mailbox.stage_state,), None, m=m, variant=variant,
                      capture=self._order.capture)  # fmt: skip
        except BaseException as error:
            self._call_failed(error)
            raise
