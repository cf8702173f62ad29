"""``LamportOp``: what every fused op shares: group, transport, mailbox, publish kernels, spin guard,
the per-call programs, warm-up and the two-phase ``publish`` / ``collect`` form.

Construction (collective over the group): validate every argument (no CUDA call, no
compile, no allocation before that), compile every kernel the op will launch, allocate the
mailbox, bind the call forms into native programs (``mhc_core.host.calls.programs``), warm up.
``super().__init__`` validates the common arguments; a subclass validates its own, then calls
``_build_publishes()`` (the arch, the spin guard, the publish kernels), compiles its collective
kernels and calls ``_setup()``.

A call is one native program call (``mhc_core.host.binaries.native``): it checks every argument,
allocates the outputs and launches, in C++; bad input raises before any launch, with the message
``mhc_core.host.calls.rules.check_call`` gives. A subclass declares its call once: the collective's
rules (``_collect_rules``), its outputs (``_output_rules``) and its launches (``_collect_launches``).

PDL: a collective may load its inputs before ``griddepcontrol.wait`` only when the
kernel right before it is a publish that waited. ``__call__`` and the loopback
driver guarantee that; ``collect(after_publish=True)`` is the caller saying so.
Otherwise the collective waits before its first load, which orders it behind
the previous kernel exactly as a launch without PDL would (one binary serves both).

Streams: a call runs on the current stream; a call on another stream than the op's
previous one waits for it first (``mhc_core.host.calls.streams.CallOrder``), so calls of one op
never overlap. For concurrent micro-batches build one op per stream: instances of one
configuration share their compiled kernels (the compile cache), only the mailbox is new.

Threads: one op's calls are atomic with respect to each other. Every public call path
(``__call__`` / ``finalize``, ``publish``, ``collect``, ``plan``'s launches, ``check``, a side
work's ``join``, the ``torch.ops.mhc`` custom ops) holds the op's lock (``_lock``, a ``threading.RLock``:
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
rank. Side work (an op's ``_side_work``) is registered before its launch, so that its tensors stay
alive until a ``join()`` whatever interrupts the call; ``join()`` still works on a poisoned op.

Modules, one job each (``LamportOp`` composes them; none names a model's attribute):

- ``op`` (this one): construction (validation, publish kernels, the startup votes, mailbox, setup);
- ``contract``: ``ModelOp``, the hooks a model's op implements (its call's rules, outputs, launches,
  allocation, warm-up values, plan arguments; its own device state);
- ``call_forms``: the call forms bound into native programs (``Programs``);
- ``eager``: the eager call, the hot path (``_call``, ``_run``, ``_check``);
- ``two_phase``: ``publish`` / ``collect`` and ``plan`` (``Plan``);
- ``warmup``: the construction's warm-up rounds;
- ``lifetime``: usability, poisoning (``OpPoisonedError``), ``check`` and ``close``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any

import torch

from ..device.configs import (
    FINALIZE_PUBLISH_KERNEL,
    PUBLISH_KERNEL,
    REDUCE_KERNEL,
    STORE_MULTICAST,
    STORE_UNICAST,
    PublishConfig,
    ReduceConfig,
)
from ..presets import MAX_TOP_K
from ..protocols import ONE_SHOT, TWO_SHOT, ProtocolChoice, choose_protocol
from . import library
from .binaries import artifacts
from .binaries.compiler import LOG, CompiledKernel, KernelSpec, compile_kernel, device_arch
from .calls.call_forms import CallForms, Programs
from .calls.contract import ModelOp, OpPreset
from .calls.eager import EagerCalls
from .calls.moe import MOE_FIELDS
from .calls.spin import SpinGuard, resolve_timeout_ms
from .calls.streams import CallOrder
from .calls.two_phase import Plan, TwoPhaseCalls
from .calls.validation import check_int
from .calls.warmup import WarmUp
from .lifetime import _CAPTURED, _RETIRED, Lifetime, OpPoisonedError
from .ranks.allocation import choose_allocation, device_identity, requested_allocation
from .ranks.groups import SUPPORTED_TP, normalize_device, resolve_group
from .ranks.mailbox import LamportMailbox, MailboxLayout, resolve_transport
from .ranks.startup import Startup, package_versions
from .ranks.startup import active as active_startup

__all__ = [
    "MAX_HIDDEN",
    "MAX_NUM_TOKENS",
    "MOE_FIELDS",
    "WEIGHT_TORCH_DTYPES",
    "_CAPTURED",
    "_RETIRED",
    "LamportOp",
    "OpPoisonedError",
    "Plan",
    "Programs",
]

#: Creation serials of the ops' locks (``LamportOp._lock_serial``); ``next`` on it is atomic.
_LOCK_SERIALS = itertools.count()
WEIGHT_TORCH_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
#: The most tokens a call can take: a publish encodes M as ``2 M + 1`` in a mailbox header word
#: that must never read as the -0 sentinel (``mhc_core.device.protocol.encode_count``).
MAX_NUM_TOKENS = 2**30 - 1
#: The largest hidden size an op takes. The kernels lay one token's CTAs along grid dimension y
#: (at most 65 535): 65 536 keeps every geometry (down to 32 threads and 8 lanes: 2 048 CTAs) far
#: inside it, and is four times the largest hidden size of a public model (16 384).
MAX_HIDDEN = 65536
#: The spin bound of a process group's warm-up at construction, in ms: the ranks are all past the
#: ``mapped`` vote, so a peer that has not published within it failed (``LamportOp._warm_up``).
WARMUP_SPIN_TIMEOUT_MS = 20_000.0


class LamportOp(CallForms, EagerCalls, TwoPhaseCalls, WarmUp, Lifetime, ModelOp):
    """Base of the fused ops (see the module docstring): construction here, each other job in its
    mixin, the model's call in the ``ModelOp`` hooks it implements."""

    #: Routing-weight dtypes the finalize publish accepts.
    weight_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    #: Whether the collective can read x itself at tp = 1 (a call then launches no publish).
    reads_x: bool = True
    #: The protocol routing (``__init__`` sets the op's own; an op assembled without it is one-shot).
    protocols = ProtocolChoice(ONE_SHOT, None, 0)
    _scatter_kernels: dict[Any, CompiledKernel] = {}  # noqa: RUF012 (read-only default: replaced per op)
    _reduce_kernel: CompiledKernel | None = None

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
        protocol: str | None = None,
        two_shot_min_tokens: int | None = None,
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
        # The startup votes of this construction (``mhc_core.host.ranks.startup``): the constructors that
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
        #: The all-reduce protocol by token count (``mhc_core.protocols``): which calls take the two-shot.
        self.protocols = choose_protocol(
            protocol, tp=self.tp, hidden=self.hidden_size, transport=self.transport, capacity=self.capacity,
            two_shot_min_tokens=two_shot_min_tokens,
        )  # fmt: skip
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
        # The two-shot's stage 1 (each slice to its owner) and its reduce, when a call can take it.
        self._scatter_configs: dict[Any, PublishConfig] = {}
        self._reduce_config: ReduceConfig | None = None
        if self.protocols.two_shot_from is not None:
            self._scatter_configs = {
                None: PublishConfig(**common, scatter=True),
                **{
                    dtype: PublishConfig(**common, top_k=self.top_k, weights=WEIGHT_TORCH_DTYPES[dtype], scatter=True)
                    for dtype in self._finalize_configs
                },
            }
            self._reduce_config = ReduceConfig(hidden=hidden_size, tp=self.tp)
        self.mailbox: LamportMailbox | None = None
        self._kernel_specs: list[KernelSpec] = []
        self._pending_m: int | None = None
        self._closed = False
        self._peers_ready = False
        self._init_call_state()

    def _init_from_preset(
        self,
        preset: OpPreset,
        *,
        publish_trigger: str,
        max_num_tokens: int,
        device: torch.device | str | int,
        group: Any = None,
        **options: Any,
    ) -> None:
        """``__init__`` for an op built from a preset (a model's ``from_config``): the preset's hidden
        size, top_k, publish threads and two-shot crossover, the core's ``options``. The group's size
        must be the preset's tp (checked here, before anything is built)."""
        options.setdefault("two_shot_min_tokens", getattr(preset, "two_shot_min_tokens", None) or None)
        LamportOp.__init__(
            self, hidden_size=preset.hidden, max_num_tokens=max_num_tokens, device=device, group=group,
            top_k=preset.top_k, publish_trigger=publish_trigger, publish_threads=preset.publish_threads, **options,
        )  # fmt: skip
        if self.tp != preset.tp:
            raise ValueError(f"group: preset {preset.name!r} is for tp = {preset.tp}, the group has tp = {self.tp}")

    def _init_call_state(self) -> None:
        """The host state every call path shares (see the module docstring, "Threads", "Exceptions")."""
        #: Held by every public call path: one op's calls are atomic with respect to each other.
        self._lock = threading.RLock()
        #: Where this op's lock comes when a call takes several ops' locks (``groups.run_ranks``):
        #: by creation, one order for the whole process.
        self._lock_serial = next(_LOCK_SERIALS)
        #: True from right before a call's native launch until the call path resets it: an exception
        #: while it is set may come after the launch (``_call_failed`` then poisons the op).
        self._in_launch = False
        #: Why the op poisoned itself on the host (``OpPoisonedError``), or None.
        self._poisoned: str | None = None
        #: The steps of ``close()`` done so far (``Lifetime._release``).
        self._close_done: set[str] = set()

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
        #: The two-shot's scatter publishes (key None: plain; else the routing weights' dtype) and reduce.
        self._scatter_kernels: dict[Any, CompiledKernel] = {
            dtype: self._compile(KernelSpec(FINALIZE_PUBLISH_KERNEL if dtype is not None else PUBLISH_KERNEL, config))
            for dtype, config in self._scatter_configs.items()
        }
        self._reduce_kernel: CompiledKernel | None = None
        if self._reduce_config is not None:
            self._reduce_kernel = self._compile(KernelSpec(REDUCE_KERNEL, self._reduce_config))

    # ------------------------------------------------------------ construction
    def _compile(self, spec: KernelSpec) -> CompiledKernel:
        """Load the kernel (shipped or cached: no DSL import), else compile it and persist it into the
        on-disk cache (``mhc_core.host.binaries.artifacts``) for the next process."""
        self._kernel_specs.append(spec)
        with torch.cuda.device(self.device):
            return compile_kernel(spec, self.arch, persist=True)

    def _mailbox_layout(self) -> MailboxLayout:
        protocols = self.protocols
        return MailboxLayout(self.tp, self.hidden_size, protocols.one_shot_capacity, protocols.two_shot_capacity)

    def _check_mailbox_fits(self) -> None:
        """The mailbox fits the device's free memory (checked before any kernel compiles)."""
        nbytes = self._mailbox_layout().elements * 2
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
        layout = self._mailbox_layout()
        self.mailbox = LamportMailbox(
            self.group, capacity=layout.one_shot_capacity, hidden=self.hidden_size, device=self.device,
            transport=self.transport, startup=startup, allocation=allocation,
            two_shot_capacity=layout.two_shot_capacity,
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
        # A warm-up that failed (here, or timed out waiting for a peer that failed) is cast in the
        # vote: every rank raises StartupError naming each failed rank and its error.
        failure = self._warm_up()
        if failure is not None and self.group.kind != "process_group":
            raise failure  # one process: no peer waits in the vote
        startup.vote("ready", {}, device=self.device, error=failure)
        startup.end()
        self._phase("warm_up")
        phases = ", ".join(f"{name} {seconds:.3f}" for name, seconds in self.construction_seconds.items())
        LOG.info("built %s in %.3f s (%s)", self, sum(self.construction_seconds.values()), phases)

    def _warm_up(self) -> Exception | None:
        """The group's warm-up of this op (``complete_construction``); what stopped it, or None. A
        process group's ranks warm up with a short spin bound of their own
        (``WARMUP_SPIN_TIMEOUT_MS``, or the op's if shorter): a peer that failed after the
        ``mapped`` vote never publishes, and the kernels waiting for it give up within seconds,
        not after the op's bound. With the bound off, the warm-up has none either (the M check
        follows the bound: it must be on on every rank's kernels alike)."""
        spin, programs = self.spin, self._programs
        bound = (spin.limit_ns, spin.timeout_ms)
        try:
            if self.group.kind == "process_group" and spin.timeout_ms and spin.timeout_ms > WARMUP_SPIN_TIMEOUT_MS:
                spin.limit_ns, spin.timeout_ms = int(WARMUP_SPIN_TIMEOUT_MS * 1e6), WARMUP_SPIN_TIMEOUT_MS
                self._programs = self._build_programs()  # the same kernels, the short bound
            with torch.cuda.device(self.device):
                self.group.complete_construction(self)
            spin.check()  # a warm-up that timed out raises here, naming the ranks that never published
        except Exception as error:
            return error
        finally:
            spin.limit_ns, spin.timeout_ms = bound
            self._programs = programs
        return None

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
            "protocol": self.protocols.requested,
            "two_shot_from": self.protocols.two_shot_from,
            "publish": dataclasses.asdict(self._publish_config),
            **self._model_fingerprint(),
        }

    def _kernels_fingerprint(self) -> dict[str, Any]:
        """The arch and every kernel's full key (``mhc_core.host.binaries.artifacts.kernel_key``): the
        ``kernels`` vote."""
        from .binaries.artifacts import kernel_key
        from .binaries.compiler import CALLING_CONVENTION

        symbols = sorted({kernel_key(spec, self.arch, CALLING_CONVENTION).symbol for spec in self._kernel_specs})
        return {"arch": self.arch, "kernels": symbols}

    def _device_fact(self) -> str | None:
        """This rank's GPU for a process group (two ranks on one GPU pick the IPC allocation)."""
        return device_identity(self.device) if self.group.kind == "process_group" else None

    def _phase(self, name: str) -> None:
        now = time.perf_counter()
        self.construction_seconds[name] = now - self._phase_start
        self._phase_start = now

    def _describe(self) -> str:
        return (
            f"hidden={self.hidden_size}, tp={self.tp}, rank={self.rank}, group={self.group.kind!r}, "
            f"transport={self.transport!r}, max_num_tokens={self.capacity}, {self._protocol_repr()}, "
            f"arch={self.arch!r}, "
            f"spin_timeout_ms={self.spin.timeout_ms}, mailbox={self.mailbox!r}"
        )

    def _protocol_repr(self) -> str:
        start = self.protocols.two_shot_from
        if start is None:
            return f"protocol={ONE_SHOT!r}"
        return (
            f"protocol={TWO_SHOT!r}" if start == 1 else f"protocol='{ONE_SHOT} below {start} tokens, else {TWO_SHOT}'"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"
