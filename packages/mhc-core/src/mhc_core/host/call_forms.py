"""An op's call forms, each bound into the native executor (``mhc_core.host.programs``): the plain
call, the MoE call per routing-weight dtype, the two phases. The publish launches are the core's; the
collective's rules, outputs and launches are the model's (``mhc_core.host.contract.ModelOp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .calls import ROWS, M, Rule, TensorRule, tensor
from .programs import AFTER_PUBLISH, DIM_M, DIM_ROWS, Fixed, Launch, Pointer, Program, Source
from .streams import SideWork


@dataclass
class Programs:
    """An op's call forms, each bound into the native executor."""

    #: A plain ``[M, hidden]`` input: publish + collective (tp = 1: the collective reads x itself).
    call: Program
    #: A ``MoEOutput`` input, per routing-weight dtype: finalize publish + collective.
    call_moe: dict[torch.dtype, Program]
    #: The two phases.
    publish: Program
    publish_moe: dict[torch.dtype, Program]
    collect: Program
    #: The rules a MoE call is explained by (every accepted weight dtype).
    moe_rules: tuple[Rule, ...] = ()


class CallForms:
    """Builds an op's ``Programs`` (a mixin of ``LamportOp``)."""

    #: The work an op with a side launch (``Program.has_side``) forks onto its side stream; set by
    #: such an op (before ``_setup``), None for one without. ``close()`` drops it.
    _side_work: SideWork | None = None

    def _side(self) -> tuple[int, int]:
        """(side stream, fork event) raw handles of an op with side-stream work, else (0, 0)."""
        side = self._side_work
        return (0, 0) if side is None else (side.handle, side.fork_handle)

    def _x_rules(self) -> tuple[Rule, ...]:
        return (tensor("x", (M, self.hidden_size), dtype=torch.bfloat16),)

    def _moe_rules(self, dtypes: Sequence[torch.dtype]) -> tuple[Rule, ...]:
        hidden, top_k = self.hidden_size, self.top_k
        return (
            tensor("shared_output", (M, hidden), dtype=torch.bfloat16),
            tensor("gemm2_permuted", (ROWS, hidden), dtype=torch.bfloat16),
            tensor("expert_weights", (M, top_k), dtype=dtypes, align=0),
            tensor("expanded_idx_to_permuted_idx", (M, top_k), dtype=torch.int32, align=4),
        )

    def _publish_fixed(self) -> dict[str, Source]:
        assert self.mailbox is not None
        return dict(
            stage_state=Fixed(self.mailbox.stage_state),
            destinations=Fixed(self.mailbox.destinations),
            rank=Fixed(self.rank),
            capacity=Fixed(self.capacity),
            token_check=Fixed(int(self.spin.checks_token_counts)),
            m=DIM_M,
        )

    def _collective_fixed(self) -> dict[str, Source]:
        """Persistent arguments of every collective kernel (``collective.mailbox_params``)."""
        assert self.mailbox is not None
        return dict(
            mailbox=Fixed(self.mailbox.buffer),
            stage_state=Fixed(self.mailbox.stage_state),
            capacity=Fixed(self.capacity),
            spin_limit_ns=Fixed(self.spin.limit_ns),
            error_flag=Fixed(self.spin.address),
            m=DIM_M,
        )

    def _build_programs(self) -> Programs:
        side_stream, fork_event = self._side()

        def program(rules: tuple[Rule, ...], outputs: tuple[TensorRule, ...], launches: list[Launch]) -> Program:
            return Program(
                rules, outputs, launches, self.device, self.capacity, side_stream, fork_event, self._order.done_handle
            )

        fixed = self._publish_fixed()
        publish = Launch(
            [self._publish_kernel.function],
            self._publish_kernel.signature,
            dict(fixed, x=Pointer("x")),
        )
        finalize = {
            dtype: Launch(
                [kernel.function],
                kernel.signature,
                dict(
                    fixed,
                    gemm2=Pointer("gemm2_permuted"),
                    weights=Pointer("expert_weights"),
                    index=Pointer("expanded_idx_to_permuted_idx"),
                    shared=Pointer("shared_output"),
                    rows=DIM_ROWS,
                    check_routes=Fixed(int(self.check_routes)),
                    error_flag=Fixed(self.spin.address),
                ),
            )
            for dtype, kernel in self._finalize_kernels.items()
        }
        x, collect, outputs = self._x_rules(), self._collect_rules(), self._output_rules()
        after_publish = self._collect_launches(direct=False, prefetch=Fixed(1))
        if self.tp == 1 and self.reads_x:  # nothing to all-reduce: one launch, the collective reads x
            call = program(x + collect, outputs, self._collect_launches(direct=True, prefetch=Fixed(0)))
        else:
            call = program(x + collect, outputs, [publish, *after_publish])
        return Programs(
            call=call,
            call_moe={
                dtype: program(self._moe_rules((dtype,)) + collect, outputs, [launch, *after_publish])
                for dtype, launch in finalize.items()
            },
            publish=program(x, (), [publish]),
            publish_moe={dtype: program(self._moe_rules((dtype,)), (), [launch]) for dtype, launch in finalize.items()},
            collect=program(collect, outputs, self._collect_launches(direct=False, prefetch=AFTER_PUBLISH)),
            moe_rules=self._moe_rules(self.weight_dtypes) + collect,
        )
