"""An op's call forms, each bound into the native executor (``mhc_core.host.calls.programs``): the plain
call, the MoE call per routing-weight dtype, the two phases. The publish launches are the core's; the
collective's rules, outputs and launches are the model's (``mhc_core.host.calls.contract.ModelOp``).

Protocols (``mhc_core.protocols``): an op with a two-shot holds both protocols' launches in every
call form, each tagged with its protocol; the native program picks by M. The routes are the union of
the model's kernel routes and the two-shot's threshold (``route_thresholds``); every launch gets one
variant per route, enabled where its protocol serves that route's M. A launch that both protocols
share (GLM's side-stream mixes) is enabled everywhere. So a forced variant (the warm-up's) picks the
same route in every launch of every program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...constants import STAGE_STATE_WORDS
from ...protocols import ONE_SHOT, TWO_SHOT
from .programs import AFTER_PUBLISH, DIM_M, DIM_ROWS, Fixed, Launch, Pointer, Program, Source
from .rules import ROWS, M, Rule, TensorRule, tensor
from .streams import SideWork

#: A launch and the protocol it belongs to (None: both).
Tagged = tuple[str | None, Launch]


def _same_source(a: Source, b: Source) -> bool:
    if isinstance(a, Fixed) and isinstance(b, Fixed):
        return a.value is b.value or (not hasattr(a.value, "data_ptr") and a.value == b.value)
    return a == b


def _shared(one: Launch, two: Launch) -> bool:
    """Whether two protocols' launches are the same launch (same kernels, sources and stream)."""
    return (
        len(one.functions) == len(two.functions)
        and all(a is b for a, b in zip(one.functions, two.functions, strict=True))
        and one.sources.keys() == two.sources.keys()
        and all(_same_source(one.sources[name], two.sources[name]) for name in one.sources)
        and (one.side, one.forks_side, tuple(one.min_tokens)) == (two.side, two.forks_side, tuple(two.min_tokens))
    )


def tag_collect_launches(one: list[Launch], two: list[Launch] | None) -> list[Tagged]:
    """The collective's launches of both protocols, in an order the executor runs either by: the
    one-shot's, then the two-shot's alternatives, each shared launch once where it stood."""
    if two is None:
        return [(None, launch) for launch in one]
    if len(one) != len(two):
        raise ValueError(f"a model's one-shot and two-shot collectives differ in launches: {len(one)} and {len(two)}")
    tagged: list[Tagged] = []
    for first, second in zip(one, two, strict=True):
        if _shared(first, second):
            tagged.append((None, first))
        else:
            tagged += [(ONE_SHOT, first), (TWO_SHOT, second)]
    # Alternatives of one step stand next to each other; a shared launch after them runs for either.
    return tagged


def route_thresholds(launches: list[Tagged], two_shot_from: int | None) -> tuple[int, ...]:
    """The routes every launch is expanded over: each launch's own thresholds and the two-shot's."""
    thresholds = {1}
    for _, launch in launches:
        thresholds.update(launch.min_tokens)
    if two_shot_from is not None:
        thresholds.add(two_shot_from)
    return tuple(sorted(thresholds))


def expand(tagged: list[Tagged], thresholds: tuple[int, ...], two_shot_from: int | None) -> list[Launch]:
    """Each launch with one variant per route (``thresholds``), enabled where its protocol serves the
    route's M (see the module docstring). A single route leaves the launches as they are."""
    if len(thresholds) == 1:
        serves = TWO_SHOT if two_shot_from == 1 else ONE_SHOT
        return [launch for protocol, launch in tagged if protocol in (None, serves)]
    launches = []
    for protocol, launch in tagged:
        functions, enabled = [], []
        for start in thresholds:
            index = max(i for i, low in enumerate(launch.min_tokens) if low <= start)
            functions.append(launch.functions[index])
            serves = TWO_SHOT if two_shot_from is not None and start >= two_shot_from else ONE_SHOT
            enabled.append(protocol is None or protocol == serves)
        launches.append(
            Launch(
                functions,
                launch.signature,
                launch.sources,
                min_tokens=thresholds,
                side=launch.side,
                forks_side=launch.forks_side,
                enabled=enabled,
            )
        )
    return launches


@dataclass
class Programs:
    """An op's call forms, each bound into the native executor."""

    #: A plain ``[M, hidden]`` input: publish + collective (tp = 1: the collective reads x itself).
    call: Program
    #: A ``MoEOutput`` input, per routing-weight dtype: finalize publish + collective.
    call_moe: dict[torch.dtype, Program]
    #: The two phases (with a two-shot, the reduce runs in the collect).
    publish: Program
    publish_moe: dict[torch.dtype, Program]
    collect: Program
    #: The rules a MoE call is explained by (every accepted weight dtype).
    moe_rules: tuple[Rule, ...] = ()
    #: A loopback driver's three phases for a two-shot (``plan``): every rank's publish, every
    #: rank's reduce (``exchange``, None without a two-shot), every rank's collective (``gather``:
    #: the collect without the reduce).
    exchange: Program | None = None
    gather: Program | None = None
    #: Every route's first M (the forced variants of the warm-up), and the two-shot's first.
    thresholds: tuple[int, ...] = (1,)
    two_shot_from: int | None = None


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

    def _publish_fixed(self, protocol: str = ONE_SHOT) -> dict[str, Source]:
        """Persistent arguments of a publish: every rank's one-shot mailbox, or (two-shot) every
        rank's reduce-scatter mailbox."""
        mailbox = self.mailbox
        assert mailbox is not None
        two_shot = protocol == TWO_SHOT
        return dict(
            stage_state=Fixed(mailbox.stage_state),
            destinations=Fixed(mailbox.scatter_destinations if two_shot else mailbox.destinations),
            rank=Fixed(self.rank),
            capacity=Fixed(mailbox.two_shot_capacity if two_shot else self._one_shot_capacity()),
            token_check=Fixed(int(self.spin.checks_token_counts)),
            m=DIM_M,
        )

    def _collective_fixed(self, protocol: str = ONE_SHOT) -> dict[str, Source]:
        """Persistent arguments of every collective kernel (``collective.mailbox_params``): this
        rank's one-shot mailbox, or (two-shot, a kernel compiled for tp = 1) its gather mailbox."""
        mailbox = self.mailbox
        assert mailbox is not None
        two_shot = protocol == TWO_SHOT
        return dict(
            mailbox=Fixed(mailbox.gather_buffer if two_shot else mailbox.buffer),
            stage_state=Fixed(mailbox.stage_state),
            capacity=Fixed(mailbox.two_shot_capacity if two_shot else self._one_shot_capacity()),
            spin_limit_ns=Fixed(self.spin.limit_ns),
            error_flag=Fixed(self.spin.address),
            m=DIM_M,
        )

    def _one_shot_capacity(self) -> int:
        """Tokens the one-shot mailbox region holds: the op's capacity, or below the two-shot's crossover."""
        protocols = self.protocols
        return self.capacity if protocols.two_shot_from is None else protocols.one_shot_capacity

    def _reduce_launch(self) -> Launch:
        """The two-shot's reduce: this rank's reduce-scatter mailbox into every rank's gather mailbox."""
        kernel, mailbox = self._reduce_kernel, self.mailbox
        assert kernel is not None and mailbox is not None
        sources = dict(
            mailbox=Fixed(mailbox.scatter_buffer),
            stage_state=Fixed(mailbox.stage_state),
            capacity=Fixed(mailbox.two_shot_capacity),
            spin_limit_ns=Fixed(self.spin.limit_ns),
            error_flag=Fixed(self.spin.address),
            destinations=Fixed(mailbox.gather_destinations),
            rank=Fixed(self.rank),
            m=DIM_M,
        )
        return Launch([kernel.function], kernel.signature, sources)

    def _build_programs(self) -> Programs:
        side_stream, fork_event = self._side()
        two_shot_from = self.protocols.two_shot_from

        def program(rules: tuple[Rule, ...], outputs: tuple[TensorRule, ...], launches: list[Launch]) -> Program:
            return Program(
                rules, outputs, launches, self.device, self.capacity, side_stream, fork_event, self._order.done_handle
            )

        def publish_launch(kernel: Any, fixed: dict[str, Source], moe: bool) -> Launch:
            sources = dict(fixed, x=Pointer("x"))
            if moe:
                sources = dict(
                    fixed,
                    gemm2=Pointer("gemm2_permuted"),
                    weights=Pointer("expert_weights"),
                    index=Pointer("expanded_idx_to_permuted_idx"),
                    shared=Pointer("shared_output"),
                    rows=DIM_ROWS,
                    check_routes=Fixed(int(self.check_routes)),
                    error_flag=Fixed(self.spin.address),
                )
            return Launch([kernel.function], kernel.signature, sources)

        def publishes(dtype: Any) -> list[Tagged]:
            """The publish of each protocol (``dtype``: None for plain input, else the routing weights')."""
            one = self._publish_kernel if dtype is None else self._finalize_kernels[dtype]
            tagged: list[Tagged] = [(ONE_SHOT, publish_launch(one, self._publish_fixed(), dtype is not None))]
            if two_shot_from is not None:
                scatter = publish_launch(self._scatter_kernels[dtype], self._publish_fixed(TWO_SHOT), dtype is not None)
                tagged.append((TWO_SHOT, scatter))
            return tagged

        def collects(prefetch: Source, two_shot_prefetch: Source) -> list[Tagged]:
            one = self._collect_launches(direct=False, prefetch=prefetch)
            two = None
            if two_shot_from is not None:
                two = self._collect_launches(direct=False, prefetch=two_shot_prefetch, protocol=TWO_SHOT)
            return tag_collect_launches(one, two)

        reduce: list[Tagged] = [] if two_shot_from is None else [(TWO_SHOT, self._reduce_launch())]
        # After its publish (a call) or after the reduce (which waited), a collective may prefetch.
        after_publish = collects(Fixed(1), Fixed(1))
        # The two-phase collect: the caller says whether a publish came right before (AFTER_PUBLISH);
        # the two-shot's boundary follows its own reduce. A loopback gather follows other ranks' kernels.
        collect = reduce + collects(AFTER_PUBLISH, Fixed(1))
        gather = collects(AFTER_PUBLISH, AFTER_PUBLISH)
        thresholds = route_thresholds(after_publish + publishes(None), two_shot_from)

        def bind(tagged: list[Tagged]) -> list[Launch]:
            return expand(tagged, thresholds, two_shot_from)

        x, rules, outputs = self._x_rules(), self._collect_rules(), self._output_rules()
        dtypes = list(self._finalize_kernels)
        if self.tp == 1 and self.reads_x:  # nothing to all-reduce: one launch, the collective reads x
            call = program(x + rules, outputs, self._collect_launches(direct=True, prefetch=Fixed(0)))
        else:
            call = program(x + rules, outputs, bind(publishes(None) + reduce + after_publish))
        exchange = None
        if two_shot_from is not None:
            # No tensor of its own: the stage state stands in, so that the call takes the current stream.
            anchor = (tensor("stage_state", (STAGE_STATE_WORDS,), dtype=torch.int32, align=4),)
            exchange = program(anchor, (), bind(reduce))
        return Programs(
            call=call,
            call_moe={
                dtype: program(
                    self._moe_rules((dtype,)) + rules, outputs, bind(publishes(dtype) + reduce + after_publish)
                )
                for dtype in dtypes
            },
            publish=program(x, (), bind(publishes(None))),
            publish_moe={dtype: program(self._moe_rules((dtype,)), (), bind(publishes(dtype))) for dtype in dtypes},
            collect=program(rules, outputs, bind(collect)),
            moe_rules=self._moe_rules(self.weight_dtypes) + rules,
            exchange=exchange,
            gather=program(rules, outputs, bind(gather)) if two_shot_from is not None else None,
            thresholds=thresholds,
            two_shot_from=two_shot_from,
        )
