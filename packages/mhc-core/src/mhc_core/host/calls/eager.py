"""The eager call path (``__call__`` / ``finalize``): the hot path, one native program call.

A call is one native program call (``mhc_core.host.binaries.native``): it checks every argument, allocates
the outputs and launches, in C++; bad input raises before any launch, with the message
``mhc_core.host.calls.rules.check_call`` gives (``_explain``). Keep this path flat: its cost is measured
in host microseconds per call (``benchmarks.host_instructions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from .moe import MOE_FIELDS, MoEOutput
from .programs import AFTER_PUBLISH_FLAG, CHECK_ONLY, FRESH_OUTPUTS, RECORD_DONE, Program
from .rules import Rule, check_call, check_storage


class EagerCalls:
    """One program call, checked and launched (a mixin of ``LamportOp``)."""

    def _publish_input(
        self, x: object, moe_programs: dict[torch.dtype, Program], plain: Program
    ) -> tuple[Program, tuple[Any, ...]]:
        """The program for a publish input (a tensor, or a ``MoEOutput`` by its weights' dtype)
        and the values it takes."""
        if not isinstance(x, MoEOutput):
            return plain, (x,)
        values = tuple(getattr(x, name) for name in MOE_FIELDS)
        return self._moe_program(moe_programs, x.expert_weights, values), values

    def _moe_program(self, programs: dict[torch.dtype, Program], weights: object, values: tuple[Any, ...]) -> Program:
        """The program for MoE input with routing weights ``weights`` (a clear error for any other)."""
        if not self.top_k:
            raise TypeError("x: this op was built with top_k = 0 and cannot take a MoEOutput")
        program = programs.get(getattr(weights, "dtype", None))  # type: ignore[arg-type]
        if program is None:  # an unaccepted dtype (or no tensor): the rules say which
            self._explain(next(iter(programs.values())), values, rules=self._programs.moe_rules[: len(MOE_FIELDS)])
        return program

    def _explain(
        self,
        program: Program,
        values: Sequence[object],
        m: int | None = None,
        outputs: Sequence[object] | None = None,
        *,
        rules: Sequence[Rule] | None = None,
        error: BaseException | None = None,
    ) -> NoReturn:
        """Raise the precise error of a call the native program rejected (or whose outputs could not
        be allocated): the rules run in Python; if they all pass, ``error`` stands as it is."""
        try:
            check_call(
                program.rules if rules is None else rules, values, capacity=self.capacity, device=self.device,
                m=m, outputs=program.outputs, out=outputs,
            )  # fmt: skip
        except (TypeError, ValueError) as precise:
            raise precise.with_traceback(None) from None
        if error is not None:
            raise error
        raise AssertionError("a rejected call whose arguments pass every rule")

    @staticmethod
    def _outputs(out: Any, program: Program) -> tuple[Any, ...]:
        """The caller's outputs, as many as the program writes (a clear error otherwise)."""
        count = len(program.outputs)
        if count <= 1:
            return (out,) if count else ()
        if not isinstance(out, (tuple, list)) or len(out) != count:
            names = ", ".join(rule.name.split(" ")[-1].strip("()") for rule in program.outputs)
            raise TypeError(f"out: expected a ({names}) tuple of {count} tensors")
        return tuple(out)

    def _hidden_like(self, like: Any, m: int) -> torch.Tensor:
        """A new ``[M, hidden]`` BF16 output: ``empty_like`` of the publish input ``like`` (x or the MoE
        shared output, already that shape and dtype), or by its shape for a collect (no input)."""
        if like is not None:
            return torch.empty_like(like)
        return torch.empty((m, self.hidden_size), dtype=torch.bfloat16, device=self.device)

    def _run(
        self,
        program: Program,
        values: tuple[Any, ...],
        out: Any,
        *,
        like: Any = None,
        collect: tuple[Any, ...] = (),
        m: int = -1,
        flags: int = 0,
        variant: int = -1,
        capture: int = 0,
        rules: Sequence[Rule] | None = None,
    ) -> Any:
        """One program call on the current stream: outputs allocated (unless given), every argument
        checked, then the launches (nothing launched on bad input); the outputs, or M for a program
        without any. ``collect``: the collect values among ``values`` (what outputs are shaped by)."""
        if not program.outputs:
            outputs: tuple[Any, ...] = ()
        elif out is None:
            flags |= FRESH_OUTPUTS
            try:
                outputs = self._allocate(like, collect, m)
            except Exception as error:  # bad inputs: the rules say which, with the project's message
                self._explain(program, values, None if m < 0 else m, rules=rules, error=error)
        else:
            outputs = self._outputs(out, program)
            if program.sized_outputs:
                self._check_storage(program, values, outputs, m, rules)
        if program.has_side:
            # Registered before the launch, so that nothing interrupting the call after it can leave
            # the side work unjoined (``SideWork.launching``).
            side_work, held = self._side_work, self._side_tensors(values, outputs)
            join, side = side_work.launching(self._order.stream, capture, held)
        else:
            join = side = 0
        if not capture:
            flags |= RECORD_DONE
        self._in_launch = True  # from here an exception may come after the launch (``_call_failed``)
        try:
            m = program.native(flags, m, variant, join, side, *values, *outputs)
        except (TypeError, ValueError) as error:  # only the native checks raise these: nothing launched
            self._in_launch = False
            given = outputs if out is not None else None
            self._explain(program, values, None if m < 0 else m, given, rules=rules, error=error)
        if program.has_side:
            side_work.launched(capture, held, self._order.stream)
        return outputs if program.outputs else m

    def _check_storage(
        self, program: Program, values: tuple[Any, ...], outputs: tuple[Any, ...], m: int, rules: Any
    ) -> None:
        """Given outputs hold the storage the kernels write past their views (``calls.check_storage``:
        what the native checks cannot see). On a failure every rule runs first, so that a wrong shape
        or dtype is named as such."""
        for index, rule in program.sized_outputs:
            try:
                check_storage(rule, outputs[index])
            except ValueError as error:
                self._explain(program, values, None if m < 0 else m, outputs, rules=rules, error=error)

    def _check(self, program: Program, values: tuple[Any, ...], out: Any, *, m: int = -1, rules: Any = None) -> int:
        """Validate a program's values (and ``out``) without launching; M."""
        outputs = program.no_outputs if out is None else self._outputs(out, program)
        if out is not None and program.sized_outputs:
            self._check_storage(program, values, outputs, m, rules)
        try:
            return int(program.native(CHECK_ONLY, m, -1, 0, 0, *values, *outputs))
        except (TypeError, ValueError) as error:
            given = outputs if out is not None else None
            self._explain(program, values, None if m < 0 else m, given, rules=rules, error=error)

    def _call(self, x: object, values: tuple[Any, ...], out: Any) -> Any:
        """One eager call (``__call__``) with a publish input ``x``: the hot path."""
        # `with`, not acquire() then `try`: an interrupt arriving as acquire() returns (the
        # interpreter checks for signals there, outside the `try`) would leave the lock held for good.
        with self._lock:
            if self._closed or self._poisoned is not None or not self._peers_ready:
                self._check_usable()
            if type(x) is torch.Tensor or not isinstance(x, MoEOutput):
                return self._launch_call(self._programs.call, (x, *values), x, values, out, None)
            fields = (x.shared_output, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx)
            return self._call_moe(fields, values, out)  # takes the lock again: an RLock

    def _call_moe(self, fields: tuple[Any, ...], values: tuple[Any, ...], out: Any) -> Any:
        """One eager call with MoE input: ``fields`` in ``MOE_FIELDS`` order."""
        with self._lock:
            if self._closed or self._poisoned is not None or not self._peers_ready:
                self._check_usable()
            programs = self._programs
            program = self._moe_program(programs.call_moe, fields[2], fields)
            return self._launch_call(program, fields + values, fields[0], values, out, programs.moe_rules)

    def _launch_call(
        self, program: Program, values: tuple[Any, ...], like: Any, collect: tuple[Any, ...], out: Any, rules: Any
    ) -> Any:
        """An eager call's launches and bookkeeping (the caller holds the lock)."""
        self.spin.check()
        if self._pending_m is not None:
            raise RuntimeError("a publish() is pending; call collect() first")
        order = self._order
        self._in_launch = False
        capture = order.begin()
        try:
            outputs = self._run(
                program, values, out, like=like, collect=collect, flags=AFTER_PUBLISH_FLAG, capture=capture, rules=rules
            )
            order.end()
        except BaseException as error:
            self._call_failed(error)
            raise
        return outputs
