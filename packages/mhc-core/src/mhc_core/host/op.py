"""``LamportOp``: what every fused op shares: group, transport, mailbox, publish kernels, spin guard,
warm-up and the two-phase ``publish`` / ``collect`` form.

Construction (collective over the group): validate every argument (no CUDA call, no
compile, no allocation before that), compile every kernel the op will launch, allocate the
mailbox, bind persistent arguments, warm up. ``super().__init__`` validates the common
arguments; a subclass validates its own, then calls ``_build_publishes()`` (the arch, the
spin guard, the publish kernels), compiles its collective kernels and calls ``_setup()``.

PDL: a collective may load its inputs before ``griddepcontrol.wait`` only when the
kernel right before it is a publish that waited. ``__call__`` and the loopback
driver guarantee that; ``collect(after_publish=True)`` is the caller saying so.
Otherwise the collective waits before its first load, which orders it behind
the previous kernel exactly as a launch without PDL would (one binary serves both).

Streams: a call runs on the current stream; a call on another stream than the op's
previous one waits for it first (``mhc_core.host.streams.CallOrder``), so calls of one op
never overlap. For concurrent micro-batches build one op per stream: instances of one
configuration share their compiled kernels (the compile cache), only the mailbox is new.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..device import protocol
from ..device.kernel import DeviceKernel
from ..device.publish import FinalizePublishKernel, PublishConfig, PublishKernel
from . import library
from .compiler import LOG, CompiledKernel, compile_kernel, device_arch
from .groups import SUPPORTED_TP, normalize_device, resolve_group
from .launch import BoundKernel
from .mailbox import LamportMailbox, mailbox_elements, resolve_transport
from .moe import MoEOutput
from .spin import SpinGuard, resolve_timeout_ms
from .streams import CallOrder
from .validation import ValidatedCalls, argument_key, check_int, check_tensor, check_token_count, leading_extent

WEIGHT_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: The most tokens a call can take: a publish encodes M as ``2 M + 1`` in a mailbox header word
#: that must never read as the -0 sentinel (``mhc_core.device.protocol.encode_count``).
MAX_NUM_TOKENS = 2**30 - 1


def _no_publish() -> None:
    """A tp = 1 plain call's publish: none (the collective reads x)."""


@dataclass
class Plan:
    """One validated call, split into its two launches (nothing launched yet)."""

    m: int
    publish: Callable[[], None]
    collect: Callable[[bool], Any]


class LamportOp:
    """Base of the fused ops (see the module docstring)."""

    #: A model op's ``_collect_launch(m, *checked_args, x=None)``: the collective's launch for
    #: checked arguments (with ``x``: the tp = 1 direct read).
    _collect_launch: Callable[..., Callable[[bool], Any]]

    #: Routing-weight dtypes the finalize publish accepts.
    weight_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

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
    ) -> None:
        # Validation only: no CUDA call, no compile, no allocation before every argument is checked.
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=8)
        if hidden_size % 8:
            raise ValueError(f"hidden_size: expected a multiple of 8, got {hidden_size}")
        self.capacity = check_int("max_num_tokens", max_num_tokens, minimum=1, maximum=MAX_NUM_TOKENS)
        self.top_k = check_int("top_k", top_k, minimum=0)
        check_int("publish_threads", publish_threads, minimum=32, maximum=1024)
        if publish_threads % 32:
            raise ValueError(f"publish_threads: expected a multiple of 32, got {publish_threads}")
        self.device = normalize_device(device)
        self.group = resolve_group(group)
        self.tp, self.rank = self.group.tp, self.group.rank
        if self.tp not in SUPPORTED_TP:
            raise ValueError(f"group: expected a TP size in {SUPPORTED_TP}, got {self.tp}")
        self.transport = resolve_transport(transport, self.group)
        self.check_routes = bool(check_routes)
        self._timeout_ms = resolve_timeout_ms(spin_timeout_ms)
        store = protocol.STORE_MULTICAST if self.transport == "multicast" else protocol.STORE_UNICAST
        common: dict[str, Any] = dict(
            hidden=hidden_size, tp=self.tp, threads=publish_threads, trigger=publish_trigger, store=store
        )
        self._publish_config = PublishConfig(**common)
        self._finalize_configs = {
            dtype: PublishConfig(**common, top_k=self.top_k, weights=WEIGHT_TORCH_DTYPES[dtype])
            for dtype in (self.weight_dtypes if self.top_k else ())
        }
        self.mailbox: LamportMailbox | None = None
        self._pending_m: int | None = None
        self._closed = False
        self._validated = ValidatedCalls()

    def _build_publishes(self) -> None:
        """After every argument is validated: the arch, the spin guard, the publish kernels."""
        self.arch = device_arch(self.device)
        self.spin = SpinGuard(self.tp, self._timeout_ms, self.device, self.rank)
        self._order = CallOrder(self.device)
        self._publish_kernel = self._compile(PublishKernel(self._publish_config))
        self._finalize_kernels: dict[torch.dtype, CompiledKernel] = {
            dtype: self._compile(FinalizePublishKernel(config)) for dtype, config in self._finalize_configs.items()
        }

    # ------------------------------------------------------------ construction
    def _compile(self, kernel: DeviceKernel) -> CompiledKernel:
        with torch.cuda.device(self.device):
            # persist: into MHC_CACHE_DIR where set (mhc_core.host.artifacts), for the next process.
            return compile_kernel(kernel, self.arch, persist=True)

    def _setup(self) -> None:
        """Allocate the mailbox (collective), bind arguments, warm up (collective)."""
        nbytes = mailbox_elements(self.tp, self.capacity, self.hidden_size) * 2
        free, _ = torch.cuda.mem_get_info(self.device)
        if nbytes > free:
            raise ValueError(
                f"max_num_tokens: a mailbox of {nbytes / 2**30:.2f} GiB per rank (tp = {self.tp}, hidden = "
                f"{self.hidden_size}, max_num_tokens = {self.capacity}) does not fit the {free / 2**30:.2f} GiB "
                f"free on {self.device}"
            )
        self.mailbox = LamportMailbox(
            self.group, capacity=self.capacity, hidden=self.hidden_size, device=self.device, transport=self.transport
        )
        #: This op in the ``torch.ops.mhc`` custom ops (``mhc_core.host.library``), with ``state``.
        self.handle = library.register(self)
        self._order.own(self.mailbox.stage_state, self.mailbox.destinations)
        if self.group.kind == "none":
            self._order.own(self.mailbox.memory)  # a loopback group owns its ranks' mailboxes
        publish_fixed = dict(
            stage_state=self.mailbox.stage_state,
            destinations=self.mailbox.destinations,
            rank=self.rank,
            capacity=self.capacity,
            token_check=int(self.spin.checks_token_counts),
        )
        self._publish = self._bind(self._publish_kernel, publish_fixed)
        self._finalize = {
            dtype: self._bind(
                kernel,
                dict(publish_fixed, check_routes=int(self.check_routes), error_flag=self.spin.address),
            )
            for dtype, kernel in self._finalize_kernels.items()
        }
        self._bind_collectives()
        with torch.cuda.device(self.device):
            self.group.complete_construction(self)
        LOG.info("built %s", self)

    def _bind(self, compiled: CompiledKernel, fixed: dict[str, Any]) -> BoundKernel:
        return BoundKernel(compiled.function, compiled.kernel.signature(), fixed, self.device)

    def _collective_fixed(self) -> dict[str, Any]:
        """Persistent arguments of every collective kernel (``collective.mailbox_params``)."""
        assert self.mailbox is not None
        return dict(
            mailbox=self.mailbox.buffer,
            stage_state=self.mailbox.stage_state,
            capacity=self.capacity,
            spin_limit_ns=self.spin.limit_ns,
            error_flag=self.spin.address,
        )

    def _bind_collectives(self) -> None:
        raise NotImplementedError

    def _warmup_collects(self) -> Sequence[Callable[[bool], Any]]:
        """One M = 1 collect per collective kernel, for the warm-up."""
        raise NotImplementedError

    def warmup_rounds(self) -> list[Plan]:
        """Rounds that launch every publish and every collective kernel at least once: what the
        op's group drives at construction (every rank's publish, then every rank's collective),
        so that no kernel is launched for the first time behind a spinning one."""
        hidden, device = self.hidden_size, self.device
        publishes: list[Callable[[], None]] = []
        x = torch.zeros(1, hidden, dtype=torch.bfloat16, device=device)
        publishes.append(lambda: self._publish(x=x, m=1))
        for dtype, bound in self._finalize.items():
            moe = MoEOutput(
                gemm2_permuted=torch.zeros(1, hidden, dtype=torch.bfloat16, device=device),
                expert_weights=torch.zeros(1, self.top_k, dtype=dtype, device=device),
                expanded_idx_to_permuted_idx=torch.full((1, self.top_k), -1, dtype=torch.int32, device=device),
                shared_output=torch.zeros(1, hidden, dtype=torch.bfloat16, device=device),
            )
            publishes.append(functools.partial(self._launch_finalize, bound, moe, 1))
        collects = list(self._warmup_collects())
        rounds = max(len(publishes), len(collects))
        return [Plan(1, publishes[i % len(publishes)], collects[i % len(collects)]) for i in range(rounds)]

    # -------------------------------------------------------------- validation
    def _checked(self, values: tuple[Any, ...], check: Callable[[], object]) -> None:
        """Run ``check`` (every check of one call's arguments; it raises before any launch) unless
        arguments with the same key (``argument_key``: every property checked) passed it before."""
        key = argument_key(*values)
        try:
            seen = key in self._validated
        except TypeError:  # an unhashable argument: the checks say what is wrong with it
            check()
            return
        if not seen:
            check()
            self._validated.add(key)

    # -------------------------------------------------------------- publishing
    def _prepare_publish(self, x: torch.Tensor | MoEOutput) -> tuple[int, Callable[[], None]]:
        """Validate a publish input; return M and the launch."""
        m = self._check_publish(x)
        return m, self._publish_launch(x, m)

    def _check_publish(self, x: torch.Tensor | MoEOutput) -> int:
        """Every check of a publish input; M."""
        if isinstance(x, MoEOutput):
            return self._check_finalize(x)
        m = check_token_count("x", leading_extent("x", x), self.capacity)
        check_tensor("x", x, shape=(m, self.hidden_size), dtype=torch.bfloat16, device=self.device)
        return m

    def _publish_launch(self, x: torch.Tensor | MoEOutput, m: int) -> Callable[[], None]:
        """The launch of a publish input already checked."""
        if isinstance(x, MoEOutput):
            return functools.partial(self._launch_finalize, self._finalize[x.expert_weights.dtype], x, m)
        publish = self._publish.launch
        return lambda: publish(x=x, m=m)

    def _plan_checked(self, x: torch.Tensor | MoEOutput, *collect_args: Any) -> Plan:
        """The plan of a call whose arguments passed every check. At tp = 1 a plain call has nothing
        to all-reduce: the collective reads x itself and no publish is launched."""
        if isinstance(x, MoEOutput):
            m = x.shared_output.shape[0]
        else:
            m = x.shape[0]
            if self.tp == 1:
                return Plan(m, _no_publish, self._collect_launch(m, *collect_args, x=x))
        return Plan(m, self._publish_launch(x, m), self._collect_launch(m, *collect_args))

    def _check_finalize(self, moe: MoEOutput) -> int:
        if not self.top_k:
            raise TypeError("x: this op was built with top_k = 0 and cannot take a MoEOutput")
        hidden, top_k, device = self.hidden_size, self.top_k, self.device
        shared = moe.shared_output
        m = check_token_count("shared_output", leading_extent("shared_output", shared), self.capacity)
        check_tensor("shared_output", shared, shape=(m, hidden), dtype=torch.bfloat16, device=device)
        rows = leading_extent("gemm2_permuted", moe.gemm2_permuted)
        check_tensor("gemm2_permuted", moe.gemm2_permuted, shape=(rows, hidden), dtype=torch.bfloat16, device=device)
        weights = moe.expert_weights
        check_tensor(
            "expert_weights",
            weights,
            shape=(m, top_k),
            dtype=self.weight_dtypes,
            device=device,
            align=weights.element_size() if isinstance(weights, torch.Tensor) else 4,
        )
        check_tensor(
            "expanded_idx_to_permuted_idx",
            moe.expanded_idx_to_permuted_idx,
            shape=(m, top_k),
            dtype=torch.int32,
            device=device,
            align=4,
        )
        return m

    def _launch_finalize(self, bound: BoundKernel, moe: MoEOutput, m: int) -> None:
        bound.launch(
            gemm2=moe.gemm2_permuted,
            weights=moe.expert_weights,
            index=moe.expanded_idx_to_permuted_idx,
            shared=moe.shared_output,
            rows=moe.gemm2_permuted.shape[0],
            m=m,
        )

    # --------------------------------------------------------------- public API
    @property
    def state(self) -> torch.Tensor:
        """The int32 stage state the kernels advance (and poison): what the ``torch.ops.mhc`` custom
        ops declare mutated, so a compiled graph keeps every call, in order (``mhc_core.host.library``)."""
        assert self.mailbox is not None, "the op is not built yet"
        return self.mailbox.stage_state

    def check(self) -> None:
        """Raise any error a kernel reported (spin timeout, bad route index)."""
        self.spin.check()

    @property
    def ready(self) -> bool:
        """Whether every rank of the op's group has built it (only loopback ranks can lag)."""
        return not self.group.missing_peers(self)

    def close(self) -> None:
        """Free the mailbox (symmetric memory for a process group) and the op's buffers, once no
        kernel can still use them; idempotent, and every later call raises. Collective over the
        group, like construction: every rank closes (a rank's peers store into its mailbox)."""
        if self._closed:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("close(): not inside a CUDA-graph capture (it synchronises the device)")
        self._closed = True
        self._release()

    #: Attributes holding device memory (or kernels bound to it, or streams recorded on it) that
    #: ``close()`` drops.
    _device_state: tuple[str, ...] = (
        "mailbox", "_publish", "_finalize", "_collective", "_boundaries", "_mixes", "_mixes_handoff",
        "_raw_mixes", "_arrivals", "_order",
    )  # fmt: skip

    def _release(self) -> None:
        """Drop every reference to device memory once the device (and, for a process group, every
        rank) is done with it. A loopback group keeps its ranks' mailboxes until it is dropped."""
        torch.cuda.synchronize(self.device)
        self.group.barrier()
        library.unregister(self.handle)
        for name in self._device_state:
            if hasattr(self, name):
                setattr(self, name, None)

    def __enter__(self) -> LamportOp:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} was closed: build a new op (collectively) to call it again")
        self.spin.check()
        missing = self.group.missing_peers(self)
        if missing:
            raise RuntimeError(
                f"loopback rank {self.rank}: this op is unusable until every rank of its LoopbackGroup "
                f"has built the same op; ranks {missing} have not"
            )

    def publish(self, x: torch.Tensor | MoEOutput) -> None:
        """Phase one: publish this rank's partial (or MoE output) for the next ``collect``."""
        self._check_usable()
        if self._pending_m is not None:
            raise RuntimeError("publish(): a previous publish() has not been collected yet; call collect() first")
        m, launch = self._prepare_publish(x)
        self._order.begin()
        launch()
        self._pending_m = m

    def _collect_pending(self, prepare: Callable[[int], Callable[[bool], Any]], after_publish: bool) -> Any:
        """Validate a collect for the pending publish's M, then launch it."""
        self._check_usable()
        if self._pending_m is None:
            raise RuntimeError("collect(): no publish() is pending; the collective would wait forever")
        collect = prepare(self._pending_m)
        self._pending_m = None
        result = collect(after_publish)
        self._order.end()
        return result

    def plan(self, method: str, *args: Any, **kwargs: Any) -> Plan:
        """Validate one ``method`` call ("call" or "finalize") without launching anything."""
        planner = getattr(self, f"_plan_{method}", None)
        if planner is None:
            raise ValueError(f"method: expected 'call' or 'finalize', got {method!r}")
        self._check_usable()
        if self._pending_m is not None:
            raise RuntimeError(f"{method}: a publish() is pending; call collect() first")
        inner = planner(*args, **kwargs)
        order = self._order

        def publish() -> None:
            order.begin()
            inner.publish()

        def collect(after_publish: bool) -> Any:
            result = inner.collect(after_publish)
            order.end()
            return result

        return Plan(inner.m, publish, collect)

    def _run(self, plan: Plan) -> Any:
        plan.publish()
        return plan.collect(True)

    def _call(self, planner: Callable[..., Plan], *args: Any, **kwargs: Any) -> Any:
        """One eager call: ``plan`` and ``_run`` without the plan's ordering wrappers (the hot path)."""
        self._check_usable()
        if self._pending_m is not None:
            raise RuntimeError("a publish() is pending; call collect() first")
        inner = planner(*args, **kwargs)
        order = self._order
        order.begin()
        inner.publish()
        result = inner.collect(True)
        order.end()
        return result

    def _describe(self) -> str:
        return (
            f"hidden={self.hidden_size}, tp={self.tp}, rank={self.rank}, group={self.group.kind!r}, "
            f"transport={self.transport!r}, max_num_tokens={self.capacity}, arch={self.arch!r}, "
            f"spin_timeout_ms={self.spin.timeout_ms}, mailbox={self.mailbox!r}"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"


def optional_output(
    name: str, out: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A caller's preallocated output, checked, or a new one."""
    if out is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return check_tensor(name, out, shape=tuple(shape), dtype=dtype, device=device)
