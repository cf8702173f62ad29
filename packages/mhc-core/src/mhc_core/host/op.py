"""``LamportOp``: what every fused op shares: group, transport, mailbox, publish kernels, spin guard,
the per-call programs, warm-up and the two-phase ``publish`` / ``collect`` form.

Construction (collective over the group): validate every argument (no CUDA call, no
compile, no allocation before that), compile every kernel the op will launch, allocate the
mailbox, bind the call forms into native programs (``mhc_core.host.programs``), warm up.
``super().__init__`` validates the common arguments; a subclass validates its own, then calls
``_build_publishes()`` (the arch, the spin guard, the publish kernels), compiles its collective
kernels and calls ``_setup()``.

A call is one native program call (``mhc_core.host.native``): it checks every argument,
allocates the outputs and launches, in C++; bad input raises before any launch, with the message
``mhc_core.host.calls.check_call`` gives. A subclass declares its call once: the collective's
rules (``_collect_rules``), its outputs (``_output_rules``) and its launches (``_collect_launches``).

PDL: a collective may load its inputs before ``griddepcontrol.wait`` only when the
kernel right before it is a publish that waited. ``__call__`` and the loopback
driver guarantee that; ``collect(after_publish=True)`` is the caller saying so.
Otherwise the collective waits before its first load, which orders it behind
the previous kernel exactly as a launch without PDL would (one binary serves both).

Streams: a call runs on the current stream; a call on another stream than the op's
previous one waits for it first (``mhc_core.host.streams.CallOrder``), so calls of one op
never overlap. For concurrent micro-batches build one op per stream: instances of one
configuration share their compiled kernels (the compile cache), only the mailbox is new.

Threads: one op's calls are atomic with respect to each other. Every public call path
(``__call__`` / ``finalize``, ``publish``, ``collect``, ``plan``'s launches, ``check``, GLM's
``join``, the ``torch.ops.mhc`` custom ops) holds the op's lock (``_lock``, a ``threading.RLock``:
~0.12 us a call) from its checks to its bookkeeping; the native call releases the GIL, so without
it two threads' launches interleaved (publish B, publish A, collective B, collective A). Calls from
several threads are serialised, in the order they take the lock; each may use its own stream. A
pending ``publish()`` is not held across threads: until its ``collect()`` (from any thread), every
other call of the op raises ``RuntimeError`` ("a publish() is pending"), as it does on one thread.

Exceptions: a call the native checks reject (``TypeError`` / ``ValueError`` before any launch), or
that fails before its launch, changes nothing: the op stays usable, a rejected ``collect()`` leaves
its publish pending. Any other exception from the moment a call enters its launch until its
bookkeeping is done (``KeyboardInterrupt`` included) leaves the op unable to say whether the call
ran on the device; so the op poisons itself on the host: every later call and ``check()`` raise
``OpPoisonedError`` naming the exception. Recovery, as after a timeout: rebuild the op on every
rank. Side work (GLM's mixes kernel) is registered before its launch, so that its tensors stay
alive until a ``join()`` whatever interrupts the call; ``join()`` still works on a poisoned op.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from ..constants import ERROR_CLOSED, ERROR_COPY, ERROR_WORD
from ..device.configs import (
    FINALIZE_PUBLISH_KERNEL,
    PUBLISH_KERNEL,
    STORE_MULTICAST,
    STORE_UNICAST,
    PublishConfig,
)
from ..presets import MAX_TOP_K
from . import artifacts, library
from .allocation import choose_allocation, device_identity, requested_allocation
from .calls import ROWS, M, Rule, TensorRule, check_call, check_storage, tensor
from .compiler import LOG, CompiledKernel, KernelSpec, compile_kernel, device_arch
from .groups import SUPPORTED_TP, normalize_device, resolve_group
from .mailbox import LamportMailbox, mailbox_elements, resolve_transport
from .moe import MoEOutput
from .programs import (
    AFTER_PUBLISH,
    AFTER_PUBLISH_FLAG,
    CHECK_ONLY,
    DIM_M,
    DIM_ROWS,
    FRESH_OUTPUTS,
    RECORD_DONE,
    Fixed,
    Launch,
    Pointer,
    Program,
    Source,
)
from .spin import SpinGuard, resolve_timeout_ms
from .startup import Startup, package_versions
from .startup import active as active_startup
from .streams import CallOrder, SideWork
from .validation import check_int

WEIGHT_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: The most tokens a call can take: a publish encodes M as ``2 M + 1`` in a mailbox header word
#: that must never read as the -0 sentinel (``mhc_core.device.protocol.encode_count``).
MAX_NUM_TOKENS = 2**30 - 1
#: The largest hidden size an op takes. The kernels lay one token's CTAs along grid dimension y
#: (at most 65 535): 65 536 keeps every geometry (down to 32 threads and 8 lanes: 2 048 CTAs) far
#: inside it, and is four times the largest hidden size of a public model (16 384).
MAX_HIDDEN = 65536
#: The MoE expert output's fields in the order a program takes them (the first binds M).
MOE_FIELDS = ("shared_output", "gemm2_permuted", "expert_weights", "expanded_idx_to_permuted_idx")
#: Ops a CUDA graph captured, by id, kept alive until ``close()``: a graph may replay them any time.
_CAPTURED: dict[int, LamportOp] = {}
#: What closed ops that a graph captured leave to their replays (``LamportOp._replay_state``), kept for
#: the life of the process: a few small buffers per op.
_RETIRED: list[tuple[Any, ...]] = []


class OpPoisonedError(RuntimeError):
    """An exception interrupted a call of the op after its kernels may have launched: the host no
    longer knows whether the call ran, so every later call raises this (rebuild the op on every rank)."""


@dataclass
class Plan:
    """One validated call, split into its two launches (nothing launched yet)."""

    m: int
    publish: Callable[[], None]
    collect: Callable[[bool], Any]


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


class LamportOp:
    """Base of the fused ops (see the module docstring)."""

    #: Routing-weight dtypes the finalize publish accepts.
    weight_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    #: Whether the collective can read x itself at tp = 1 (a call then launches no publish).
    reads_x: bool = True
    #: The work an op with a side launch (``Program.has_side``) forks onto its side stream; set by
    #: such an op, never read by one without.
    _side_work: SideWork

    def __init__(
        self,
        *,
        hidden_size: int,
        max_num_tokens: int,
        device: torch.device | str | int,
        group: Any = None,
        transport: str | None = None,
        top_k: int = 0,
        publish_trigger: str,
        publish_threads: int = 128,
        spin_timeout_ms: float | None = None,
        check_routes: bool = False,
        mailbox_allocation: str | None = None,
    ) -> None:
        # Validation only: no CUDA call, no compile, no allocation before every argument is checked.
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=8, maximum=MAX_HIDDEN)
        if hidden_size % 8:
            raise ValueError(f"hidden_size: expected a multiple of 8, got {hidden_size}")
        self.capacity = check_int("max_num_tokens", max_num_tokens, minimum=1, maximum=MAX_NUM_TOKENS)
        self.top_k = check_int("top_k", top_k, minimum=0, maximum=MAX_TOP_K)
        check_int("publish_threads", publish_threads, minimum=32, maximum=1024)
        if publish_threads % 32:
            raise ValueError(f"publish_threads: expected a multiple of 32, got {publish_threads}")
        self.device = normalize_device(device)
        # The startup votes of this construction (``mhc_core.host.startup``): the constructors that
        # ``collective`` wraps share one; any other subclass gets its own here.
        self._startup = active_startup() or Startup(resolve_group(group))
        self.group = self._startup.group
        self.tp, self.rank = self.group.tp, self.group.rank
        if self.tp not in SUPPORTED_TP:
            raise ValueError(f"group: expected a TP size in {SUPPORTED_TP}, got {self.tp}")
        self.transport = resolve_transport(transport, self.group)
        self._allocation_request = requested_allocation(mailbox_allocation)
        if self.transport == "multicast" and self._allocation_request == "ipc":
            raise ValueError("mailbox_allocation='ipc' has no NVLink multicast mapping: transport='multicast' needs it")
        self.check_routes = bool(check_routes)
        self._timeout_ms = resolve_timeout_ms(spin_timeout_ms)
        artifacts.enabled()  # MHC_PREBUILT: a value it cannot honour raises now, not at the first compile
        store = STORE_MULTICAST if self.transport == "multicast" else STORE_UNICAST
        common: dict[str, Any] = dict(
            hidden=hidden_size, tp=self.tp, threads=publish_threads, trigger=publish_trigger, store=store
        )
        self._publish_config = PublishConfig(**common)
        self._finalize_configs = {
            dtype: PublishConfig(**common, top_k=self.top_k, weights=WEIGHT_TORCH_DTYPES[dtype])
            for dtype in (self.weight_dtypes if self.top_k else ())
        }
        self.mailbox: LamportMailbox | None = None
        self._kernel_specs: list[KernelSpec] = []
        self._pending_m: int | None = None
        self._closed = False
        self._peers_ready = False
        self._init_call_state()

    def _init_call_state(self) -> None:
        """The host state every call path shares (see the module docstring, "Threads", "Exceptions")."""
        #: Held by every public call path: one op's calls are atomic with respect to each other.
        self._lock = threading.RLock()
        #: True from right before a call's native launch until the call path resets it: an exception
        #: while it is set may come after the launch (``_call_failed`` then poisons the op).
        self._in_launch = False
        #: Why the op poisoned itself on the host (``OpPoisonedError``), or None.
        self._poisoned: str | None = None

    def _build_publishes(self) -> None:
        """After every argument is validated: the arch, the spin guard, the publish kernels."""
        #: Seconds per construction phase (``kernels`` loaded or compiled, ``mailbox``, ``programs``,
        #: ``warm_up``: a loopback rank's is the whole group's, on its last rank), logged when built.
        self.construction_seconds: dict[str, float] = {}
        self._phase_start = time.perf_counter()
        self._startup.vote("config", self._fingerprint(), device=self.device)  # before the device is touched
        self.arch = device_arch(self.device)
        self._check_mailbox_fits()  # before the first compile: a mailbox that cannot fit costs none
        self.spin = SpinGuard(self.tp, self._timeout_ms, self.device, self.rank)
        self._order = CallOrder(self.device)
        self._order.on_first_capture = self._outlive_graphs
        self._publish_kernel = self._compile(KernelSpec(PUBLISH_KERNEL, self._publish_config))
        self._finalize_kernels: dict[torch.dtype, CompiledKernel] = {
            dtype: self._compile(KernelSpec(FINALIZE_PUBLISH_KERNEL, config))
            for dtype, config in self._finalize_configs.items()
        }

    # ------------------------------------------------------------ construction
    def _compile(self, spec: KernelSpec) -> CompiledKernel:
        """Load the kernel (shipped or cached: no DSL import), else compile it and persist it into the
        on-disk cache (``mhc_core.host.artifacts``) for the next process."""
        self._kernel_specs.append(spec)
        with torch.cuda.device(self.device):
            return compile_kernel(spec, self.arch, persist=True)

    def _check_mailbox_fits(self) -> None:
        """The mailbox fits the device's free memory (checked before any kernel compiles)."""
        nbytes = mailbox_elements(self.tp, self.capacity, self.hidden_size) * 2
        free, _ = torch.cuda.mem_get_info(self.device)
        if nbytes > free:
            raise ValueError(
                f"max_num_tokens: a mailbox of {nbytes / 2**30:.2f} GiB per rank (tp = {self.tp}, hidden = "
                f"{self.hidden_size}, max_num_tokens = {self.capacity}) does not fit the {free / 2**30:.2f} GiB "
                f"free on {self.device}"
            )

    def _setup(self) -> None:
        """Allocate the mailbox (collective), bind the programs, warm up (collective)."""
        self._phase("kernels")
        startup = self._startup
        devices = startup.vote("kernels", self._kernels_fingerprint(), self._device_fact(), self.device)
        allocation = self.group.kind  # "none" and "loopback": this process's own buffers
        if self.group.kind == "process_group":
            allocation = choose_allocation(self._allocation_request, devices, self.transport)
        self.mailbox = LamportMailbox(
            self.group, capacity=self.capacity, hidden=self.hidden_size, device=self.device, transport=self.transport,
            startup=startup, allocation=allocation,
        )  # fmt: skip
        #: This op in the ``torch.ops.mhc`` custom ops (``mhc_core.host.library``), with ``state``.
        self.handle = library.register(self)
        self._order.own(self.mailbox.stage_state, self.mailbox.destinations)
        if self.group.kind == "none":
            self._order.own(self.mailbox.memory)  # a loopback group owns its ranks' mailboxes
        self._phase("mailbox")
        self._programs = self._build_programs()
        self._phase("programs")
        startup.vote("mapped", {}, device=self.device)  # every rank can launch: none warms up alone
        with torch.cuda.device(self.device):
            self.group.complete_construction(self)
        self.spin.check()  # a warm-up that timed out fails here, and the vote below tells every peer
        startup.vote("ready", {}, device=self.device)
        startup.end()
        self._phase("warm_up")
        phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.construction_seconds.items())
        LOG.info("built %s in %.3f s (%s)", self, sum(self.construction_seconds.values()), phases)

    def _fingerprint(self) -> dict[str, Any]:
        """What every rank's op must agree on before anything is allocated (the ``config`` vote)."""
        return {
            "op": f"{type(self).__module__}.{type(self).__qualname__}",
            "versions": package_versions(type(self).__module__),
            "tp": self.tp,
            "hidden_size": self.hidden_size,
            "max_num_tokens": self.capacity,
            "top_k": self.top_k,
            "transport": self.transport,
            "mailbox_allocation": self._allocation_request,
            "spin_timeout_ms": self._timeout_ms,
            "publish": dataclasses.asdict(self._publish_config),
            **self._model_fingerprint(),
        }

    def _model_fingerprint(self) -> dict[str, Any]:
        """A model's own fields of the ``config`` fingerprint (hc, geometry, epsilons ...)."""
        return {}

    def _kernels_fingerprint(self) -> dict[str, Any]:
        """The arch and every kernel's full key (``mhc_core.host.artifacts.kernel_key``): the ``kernels`` vote."""
        from .artifacts import kernel_key
        from .compiler import CALLING_CONVENTION

        symbols = sorted({kernel_key(spec, self.arch, CALLING_CONVENTION).symbol for spec in self._kernel_specs})
        return {"arch": self.arch, "kernels": symbols}

    def _device_fact(self) -> str | None:
        """This rank's GPU for a process group (two ranks on one GPU pick the IPC allocation)."""
        return device_identity(self.device) if self.group.kind == "process_group" else None

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self.construction_seconds[name] = now - self._phase_start
        self._phase_start = now

    # ---------------------------------------------------------------- the calls
    def _collect_rules(self) -> tuple[Rule, ...]:
        """The collective's per-call parameters (after the publish input), in check order."""
        raise NotImplementedError

    def _output_rules(self) -> tuple[TensorRule, ...]:
        """The outputs, in the order a call returns them."""
        raise NotImplementedError

    def _collect_launches(self, *, direct: bool, prefetch: Source) -> list[Launch]:
        """The collective's launches. ``direct``: tp = 1, the collective reads the parameter ``x``."""
        raise NotImplementedError

    def _side(self) -> tuple[int, int]:
        """(side stream, fork event) raw handles of an op with side-stream work, else (0, 0)."""
        return 0, 0

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

    def _allocate(self, like: Any, values: tuple[Any, ...], m: int) -> tuple[torch.Tensor, ...]:
        """New outputs for a call whose publish input is ``like`` (x or the MoE shared output; None
        for a collect, then M is ``m``) and whose collect values are ``values``. Allocated by torch
        (``empty_like`` of an input of the same shape and dtype where there is one: the cheapest
        allocation torch offers from Python), so they are ordinary torch tensors."""
        raise NotImplementedError

    def _hidden_like(self, like: Any, m: int) -> torch.Tensor:
        """A new ``[M, hidden]`` BF16 output: ``empty_like`` of the publish input ``like`` (x or the MoE
        shared output, already that shape and dtype), or by its shape for a collect (no input)."""
        if like is not None:
            return torch.empty_like(like)
        return torch.empty((m, self.hidden_size), dtype=torch.bfloat16, device=self.device)

    def _returns(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        """What a call returns, given its outputs (the all-reduce returns its one tensor)."""
        return outputs

    def _side_tensors(self, values: Sequence[object], outputs: Sequence[torch.Tensor]) -> tuple[Any, ...]:
        """What the side kernel of a program with a side launch (``Program.has_side``) uses, possibly
        after the current stream has dropped it: ``_side_work`` keeps it alive until the work is joined."""
        raise NotImplementedError

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
        lock = self._lock
        lock.acquire()  # not `with`: half the cost on the hot path
        try:
            if self._closed or self._poisoned is not None or not self._peers_ready:
                self._check_usable()
            if type(x) is torch.Tensor or not isinstance(x, MoEOutput):
                return self._launch_call(self._programs.call, (x, *values), x, values, out, None)
            fields = (x.shared_output, x.gemm2_permuted, x.expert_weights, x.expanded_idx_to_permuted_idx)
            return self._call_moe(fields, values, out)  # takes the lock again: an RLock
        finally:
            lock.release()

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

    def _call_failed(self, error: BaseException) -> None:
        """A call path raised. Before its launch (rejected by the native checks, or failed earlier)
        nothing changed; from its launch on, the op poisons itself (see the module docstring)."""
        if self._in_launch:
            self._poison(error)
        self._order.cancel()

    def _poison(self, error: BaseException) -> None:
        """Make every later call (and ``check()``) raise ``OpPoisonedError`` saying why. Only the
        message is kept: the exception's traceback would keep the call's tensors alive."""
        what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self._poisoned = (
            f"{type(self).__name__} (rank {self.rank}) is unusable: a call raised {what} after its kernels may "
            "have launched, so this process cannot tell whether the call ran on the device (the mailbox "
            "generation, a pending publish or side work may be ahead of what the host knows); rebuild the op "
            "on every rank"
        )

    def _ensure_usable(self) -> None:
        """The hot paths' check: ``_check_usable`` only when something may be wrong."""
        if self._closed or self._poisoned is not None or not self._peers_ready:
            self._check_usable()

    # --------------------------------------------------------------- public API
    @property
    def state(self) -> torch.Tensor:
        """The int32 stage state the kernels advance (and poison): what the ``torch.ops.mhc`` custom
        ops declare mutated, so a compiled graph keeps every call, in order (``mhc_core.host.library``)."""
        assert self.mailbox is not None, "the op is not built yet"
        return self.mailbox.stage_state

    def check(self) -> None:
        """Raise any error a kernel reported (spin timeout, bad route index), or the op's poisoning."""
        with self._lock:
            self.spin.check()
            if self._poisoned is not None:
                raise OpPoisonedError(self._poisoned)

    @property
    def ready(self) -> bool:
        """Whether every rank of the op's group has built it (only loopback ranks can lag)."""
        return not self.group.missing_peers(self)

    def close(self) -> None:
        """Free the mailbox (symmetric memory for a process group) and the op's buffers, once no
        kernel can still use them; idempotent, and every later call raises. Collective over the
        group, like construction: every rank closes (a rank's peers store into its mailbox).

        CUDA graphs that captured the op may outlive it: close() first poisons the op on the device
        (its stage state's error word), so a later replay runs kernels that touch no mailbox and
        write NaN outputs, then frees the mailbox and keeps, for the life of the process, the few
        small buffers such a replay still touches (stage state, destination table, error report,
        events, GLM's hand-off rows). An op a graph captured is kept alive until close(), whatever
        references the caller drops: garbage collection never frees memory a replay could write."""
        with self._lock:  # a call in flight on another thread finishes first
            if self._closed:
                return
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("close(): not inside a CUDA-graph capture (it synchronises the device)")
            self._closed = True
            self._release()

    #: Attributes holding device memory (or programs bound to it, or streams recorded on it) that
    #: ``close()`` drops.
    _device_state: tuple[str, ...] = (
        "mailbox", "_programs", "_publish_kernel", "_finalize_kernels", "_mixes_handoff", "_raw_mixes",
        "_arrivals", "_order", "_side_work",
    )  # fmt: skip

    def _outlive_graphs(self) -> None:
        """The op's first call inside a CUDA-graph capture: keep the op alive until ``close()``."""
        _CAPTURED[id(self)] = self

    def _release(self) -> None:
        """Drop every reference to device memory once the device (and, for a process group, every
        rank) is done with it. A loopback group keeps its ranks' mailboxes until it is dropped. An op
        a graph captured is poisoned first (on every rank before the barrier) and leaves what its
        replays touch in ``_RETIRED``."""
        torch.cuda.synchronize(self.device)
        captured = _CAPTURED.pop(id(self), None) is not None
        if captured and self.mailbox is not None:
            self._poison_replays(self.mailbox.stage_state)
        self.group.barrier()
        library.unregister(self.handle)
        if captured and self.mailbox is not None:
            _RETIRED.append(self._replay_state(self.mailbox))
        for name in self._device_state:
            if hasattr(self, name):
                setattr(self, name, None)

    def _poison_replays(self, stage_state: torch.Tensor) -> None:
        """Set both copies of the op's device error word: every kernel launched or replayed from now
        on is poisoned (it polls, re-arms and stores into no mailbox, and writes NaN)."""
        with torch.cuda.device(self.device):
            stage_state[ERROR_WORD] = ERROR_CLOSED
            stage_state[ERROR_COPY] = ERROR_CLOSED
        torch.cuda.synchronize(self.device)

    def _replay_state(self, mailbox: LamportMailbox) -> tuple[Any, ...]:
        """What a poisoned replay of this op's kernels still reads or writes: everything but the
        mailbox's memory (the order keeps only the stage state and destination table recorded)."""
        self._order.keep_owned(mailbox.stage_state, mailbox.destinations)
        kept = (name for name in self._device_state if name not in ("mailbox", "_programs"))
        return (mailbox.stage_state, mailbox.destinations, self.spin, *(getattr(self, name, None) for name in kept))

    def __enter__(self) -> LamportOp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed: build a new op (collectively) to call it again")
        self.spin.check()
        if self._poisoned is not None:
            raise OpPoisonedError(self._poisoned)
        missing = self.group.missing_peers(self)
        if missing:
            raise RuntimeError(
                f"loopback rank {self.rank}: this op is unusable until every rank of its LoopbackGroup "
                f"has built the same op; ranks {missing} have not"
            )
        self._peers_ready = True  # ranks never leave a group: no need to ask again

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
                self._pending_m = int(self._run(program, values, None, capture=capture, rules=rules))
            except BaseException as error:
                self._call_failed(error)
                raise

    def _collect_pending(self, values: tuple[Any, ...], out: Any, after_publish: bool) -> Any:
        """Validate and launch the collective for the pending publish's M."""
        with self._lock:
            self._check_usable()
            if self._pending_m is None:
                raise RuntimeError("collect(): no publish() is pending; the collective would wait forever")
            flags = AFTER_PUBLISH_FLAG if after_publish else 0
            self._in_launch = False
            try:
                outputs = self._run(
                    self._programs.collect, values, out, collect=values, m=self._pending_m, flags=flags,
                    capture=self._order.capture,
                )  # fmt: skip
                self._pending_m = None  # only now: a rejected collect leaves the publish pending, to collect again
                self._order.end()
            except BaseException as error:
                self._call_failed(error)
                raise
            return self._returns(outputs)

    def _plan_values(self, method: str, *args: Any, **kwargs: Any) -> tuple[object, tuple[Any, ...], Any]:
        """(publish input, collect values, out) of a ``method`` call's arguments."""
        raise NotImplementedError

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
            self._check(programs.collect, values, out, m=m)
            return self._plan(m, (publish, inputs), dict(program=programs.collect, values=values, m=m), values, out)

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

        return Plan(m, run_publish, run_collect)

    # ---------------------------------------------------------------- warm-up
    def _warmup_collects(self) -> Sequence[tuple[tuple[Any, ...], int]]:
        """``(collect values, variant)`` at M = 1 for each collective kernel, for the warm-up."""
        raise NotImplementedError

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

    def _describe(self) -> str:
        return (
            f"hidden={self.hidden_size}, tp={self.tp}, rank={self.rank}, group={self.group.kind!r}, "
            f"transport={self.transport!r}, max_num_tokens={self.capacity}, arch={self.arch!r}, "
            f"spin_timeout_ms={self.spin.timeout_ms}, mailbox={self.mailbox!r}"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"
