"""Issue #32 on a CPU: sequences of calls a user makes that must never turn into silent garbage.

* Threads: ops whose kernels are recorders (``tests.core.test_launch_wiring_cpu``) run their real
  native programs, which release the GIL; recorders that sleep let another thread in, as the
  H200's launches did. One op's calls, from two threads, must launch in whole calls.
* Exceptions: a ``KeyboardInterrupt`` injected before or after a call's native launch (by wrapping
  the program's native function): before, nothing changes; after, the op poisons itself.
* Bounds: every numeric argument and ``MHC_*`` variable that the kernels cannot honour is refused
  before the build starts (``device_arch``, patched to raise), naming the value and the range.
* ``lamport_all_reduce``'s cache of ops, with a fake op class: keyed by the group itself and by
  every setting, and an op it replaces is closed.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import tvm_ffi

from tests.core.test_launch_wiring_cpu import (
    HIDDEN,
    Kernels,
    M,
    common,
    dsv_args,
    dsv_op,
    glm_args,
    glm_op,
    moe_fields,
)

GOOD_CORE = dict(hidden_size=4096, max_num_tokens=8, device="cuda:0")
GOOD_DSV = dict(hidden_size=5120, hc_mult=4, max_num_tokens=8, top_k=8, device="cuda:0")
GOOD_GLM = dict(
    hidden_size=4096, max_num_tokens=8, rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20,
    norm_eps=1e-5, device="cuda:0", top_k=8,
)  # fmt: skip


# ------------------------------------------------------------------ threads
class SlowKernels(Kernels):
    """Recorders that also note the calling thread and sleep a little: the sleep lets another
    thread run while this one is inside the native call (the GIL is released there)."""

    def compiled(self, name: str, kernel) -> SimpleNamespace:
        signature = kernel.signature()

        def record(*args) -> None:
            self.calls.append((name, threading.get_ident()))
            time.sleep(0.0002)

        return SimpleNamespace(function=tvm_ffi.convert(record), kernel=kernel, signature=signature)


def slow_all_reduce(tp: int = 2) -> tuple[Any, SlowKernels]:
    """A ``LamportAllReduce`` (with MoE input) whose kernels are slow recorders."""
    from mhc_core import LamportAllReduce
    from mhc_core.device.configs import CollectiveConfig
    from mhc_core.device.one_shot.collective import CollectiveKernel

    kernels = SlowKernels()
    op = object.__new__(LamportAllReduce)
    common(op, tp, kernels)
    collective = kernels.compiled("collective", CollectiveKernel(CollectiveConfig(hidden=HIDDEN, tp=tp)))
    op.__dict__.update(lanes=1, _collective_kernel=collective)
    op._programs = op._build_programs()
    return op, kernels


def run_threads(*bodies: Callable[[], None]) -> None:
    """Run each body on its own thread; re-raise the first failure."""
    failures: list[BaseException] = []

    def guarded(body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as error:  # reported on the main thread
            failures.append(error)

    threads = [threading.Thread(target=guarded, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def assert_whole_calls(kernels: SlowKernels, count: int) -> None:
    """The recorded launches are ``count`` whole calls (a publish, plain or finalize, then its
    collective), one thread's at a time."""
    calls = kernels.calls
    assert len(calls) == 2 * count, f"{len(calls)} launches for {count} calls"
    for start in range(0, len(calls), 2):
        (publish, first), (collective, second) = calls[start : start + 2]
        assert publish in ("publish", "finalize") and collective == "collective" and first == second, (
            f"launches {start}, {start + 1}: {calls[start : start + 2]} interleave two calls"
        )


def retry_while_pending(step: Callable[[], Any]) -> Any:
    """``step()``, again while another thread's publish is pending (the documented RuntimeError)."""
    while True:
        try:
            return step()
        except RuntimeError as error:
            if "pending" not in str(error) and "not been collected" not in str(error):
                raise
            time.sleep(0)


def test_two_threads_calling_one_op_launch_whole_calls() -> None:
    """Row 1 of the issue: two threads, one op (plain input on one, MoE input on the other). The
    native call releases the GIL: without the op's lock the launches interleaved (publish B,
    publish A, collective B, collective A)."""
    from mhc_core import MoEOutput

    op, kernels = slow_all_reduce()
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    gemm2, weights, index, shared = moe_fields()
    moe = MoEOutput(gemm2, weights, index, shared)

    def calls(value: Any) -> Callable[[], None]:
        def body() -> None:
            for _ in range(40):
                op(value)

        return body

    run_threads(calls(x), calls(moe))
    assert_whole_calls(kernels, 2 * 40)


def test_publish_and_collect_from_two_threads_never_interleave() -> None:
    """A pending publish() makes another thread's publish raise (it retries) until its collect()."""
    op, kernels = slow_all_reduce()
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)

    def body() -> None:
        for _ in range(30):
            retry_while_pending(lambda: op.publish(x))
            op.collect()

    run_threads(body, body)
    assert_whole_calls(kernels, 2 * 30)


def test_run_ranks_from_two_threads_never_interleave() -> None:
    """A run holds its ops from the first plan to the last collect: another thread's run waits."""
    from mhc_core import run_ranks

    op, kernels = slow_all_reduce()
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)

    def body() -> None:
        for _ in range(30):
            run_ranks([op], "call", [(x,)])

    run_threads(body, body)
    assert_whole_calls(kernels, 2 * 30)


# --------------------------------------------------------------- exceptions
def interrupt(program: Any, *, after_launch: bool) -> None:
    """Make ``program``'s next launching native call (not a check-only one) raise KeyboardInterrupt
    as it starts (nothing launched yet) or once it returns (everything launched)."""
    from mhc_core.host.calls.programs import CHECK_ONLY

    real = program.native

    def native(flags: int, *args: Any) -> Any:
        if flags & CHECK_ONLY:
            return real(flags, *args)
        program.native = real  # once
        if after_launch:
            real(flags, *args)
        raise KeyboardInterrupt

    program.native = native


def interrupt_allocation(op: Any) -> None:
    """Make the op's next output allocation (before any launch) raise KeyboardInterrupt."""
    real = op._allocate

    def allocate(*args: Any) -> Any:
        op._allocate = real  # once
        raise KeyboardInterrupt

    op._allocate = allocate


POISONED = r"is unusable: a call raised KeyboardInterrupt after its kernels may have launched.*rebuild the op"


def assert_poisoned(call: Callable[[], Any], kernels: Kernels) -> None:
    """``call()`` raises the op's poisoning (``OpPoisonedError``, a RuntimeError) and launches nothing."""
    launched = len(kernels.calls)
    with pytest.raises(RuntimeError, match=POISONED) as caught:
        call()
    assert type(caught.value).__name__ == "OpPoisonedError"
    assert len(kernels.calls) == launched, "a poisoned op launched"


@pytest.mark.parametrize("method", ["__call__", "finalize"])
def test_an_interrupt_before_the_launch_changes_nothing_after_it_poisons(method: str) -> None:
    """``_launch_call`` took any exception for "nothing launched": an interrupt after the native
    launch left an op that went on as if the call had not run (its peers saw it run). From the
    native call's start the op cannot know whether it launched: it poisons itself from there."""
    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    program = op._programs.call if method == "__call__" else op._programs.call_moe[torch.float32]
    inputs = (x,) if method == "__call__" else moe_fields()

    def call() -> Any:
        return op(*inputs, *dsv_args()) if method == "__call__" else op.finalize(*inputs, *dsv_args())

    interrupt_allocation(op)
    with pytest.raises(KeyboardInterrupt):
        call()
    assert kernels.calls == [], "interrupted before its launch: nothing launched"
    call()  # usable: nothing changed
    assert len(kernels.calls) == 2
    interrupt(program, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        call()
    assert len(kernels.calls) == 4, "the interrupted call launched"
    assert_poisoned(call, kernels)
    assert_poisoned(op.check, kernels)
    assert_poisoned(lambda: op.publish(x), kernels)


def test_a_publish_interrupted_after_its_launch_poisons_the_op() -> None:
    """The publish ran, but its M was never recorded: a next call would publish a second time into
    the same generation."""
    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    interrupt(op._programs.publish, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        op.publish(x)
    assert kernels.names() == ["publish"]
    assert_poisoned(lambda: op(x, *dsv_args()), kernels)
    assert_poisoned(lambda: op.collect(*dsv_args()), kernels)


def test_a_collect_interrupted_after_its_launch_is_not_collected_again() -> None:
    """``_collect_pending`` kept the pending M for any exception: a retried collect() launched a
    second collective, which polls slots the first one re-armed (a hang, or a timeout)."""
    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    op.publish(x)
    with pytest.raises(ValueError, match=r"residual: expected shape \[3, 4, 64\]"):
        op.collect(*dsv_args(2))  # rejected before any launch: the publish stays pending
    interrupt(op._programs.collect, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        op.collect(*dsv_args())
    assert kernels.names() == ["publish", "collective"]
    assert_poisoned(lambda: op.collect(*dsv_args()), kernels)  # not a second collective


def test_run_ranks_interrupted_between_its_phases_leaves_the_publish_pending() -> None:
    """A plan's publish that ran is pending like publish()'s: a later call raises until collect()
    finishes it, instead of publishing into the same generation again."""
    from mhc_core import run_ranks

    op, kernels = dsv_op(2)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    interrupt_allocation(op)  # the collect's outputs: after the publish, before the collective
    with pytest.raises(KeyboardInterrupt):
        run_ranks([op], "call", [(x, *dsv_args())])
    assert kernels.names() == ["publish"]
    with pytest.raises(RuntimeError, match=r"a publish\(\) is pending"):
        op(x, *dsv_args())
    op.collect(*dsv_args())
    op(x, *dsv_args())
    assert kernels.names() == ["publish", "collective", "publish", "collective"]


def test_glm_side_work_is_registered_even_when_the_call_is_interrupted_after_its_launch() -> None:
    """An interrupt between the native return and the GLM op's bookkeeping left the mixes kernel
    unjoined: the next boundary could overwrite hand-off rows it had not read, and the side
    outputs could go back to the allocator while it wrote them."""
    op, kernels, side = glm_op(1)
    registered: list[tuple] = []
    side.launching = lambda stream, capture, tensors: registered.append(tuple(tensors)) or (0, 0)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    args = glm_args()
    out = [torch.empty(M, 4, HIDDEN).to(torch.bfloat16), torch.empty(M, 4, 1), torch.empty(M, 4, 4)]
    out.append(torch.empty(M, HIDDEN).to(torch.bfloat16))
    interrupt(op._programs.call, after_launch=True)
    with pytest.raises(KeyboardInterrupt):
        op(x, *args, out=out)
    assert kernels.names() == ["boundary", "mixes"]
    assert registered == [(out[1], out[2], args[4], args[5])], "the side kernel's tensors are kept until a join"
    assert_poisoned(lambda: op(x, *args), kernels)


# -------------------------------------------------------------------- bounds
class BuildStarted(Exception):
    """Raised where construction leaves validation (the arch is read): every check has passed."""


@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import mhc_core.host.op

    def started(device: Any) -> None:
        raise BuildStarted(str(device))

    monkeypatch.setattr(mhc_core.host.op, "device_arch", started)


def op_type(family: str) -> tuple[type, dict[str, Any]]:
    from mhc_core import LamportAllReduce
    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

    return {
        "core": (LamportAllReduce, GOOD_CORE),
        "dsv41": (AllReduceMHC, GOOD_DSV),
        "glm5": (AllReduceMhcBoundary, GOOD_GLM),
    }[family]


def refused(family: str, error: type[Exception] | tuple[type[Exception], ...], message: str, **arguments: Any) -> None:
    """Building ``family`` with ``arguments`` raises ``error`` containing ``message`` before the build."""
    cls, good = op_type(family)
    try:
        cls(**{**good, **arguments})
    except BuildStarted:
        raise AssertionError(f"{family} {arguments}: accepted (construction went on to the build)") from None
    except error as raised:
        assert message in str(raised), f"{family} {arguments}: {raised}"
    else:
        raise AssertionError(f"{family} {arguments}: no error")


SPIN_RANGE = "expected 0 (off) or a finite value in [0.001, 1e+09] ms"


@pytest.mark.usefixtures("no_build")
@pytest.mark.parametrize("family", ["core", "dsv41", "glm5"])
def test_spin_bounds_that_cannot_be_honoured_are_refused(family: str) -> None:
    """inf raised OverflowError after validation; 1e-7 rounded to 0 ns (the bound and the M check
    silently off while the op said 1e-07); 5e12 overflowed the hand-off's Int64 limit."""
    for value in (float("inf"), 1e-7, 5e12, float("nan"), -1.0, 1e300):
        refused(family, ValueError, f"spin_timeout_ms: {SPIN_RANGE}, got {value}", spin_timeout_ms=value)
    cls, good = op_type(family)
    for value in (0, 0.001, 1e9):  # off, and both ends of the range
        with pytest.raises(BuildStarted):
            cls(**{**good, "spin_timeout_ms": value})


@pytest.mark.usefixtures("no_build")
def test_spin_bounds_from_the_environment_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("inf", "1e-7", "5e12", "nan", "-5", "soon"):
        monkeypatch.setenv("MHC_SPIN_TIMEOUT_MS", raw)
        refused("core", ValueError, f"MHC_SPIN_TIMEOUT_MS: {SPIN_RANGE}, got")
    for raw in ("0", "0.001", "1e9", "2000"):
        monkeypatch.setenv("MHC_SPIN_TIMEOUT_MS", raw)
        with pytest.raises(BuildStarted):
            op_type("core")[0](**GOOD_CORE)


@pytest.mark.usefixtures("no_build")
def test_a_negative_zero_spin_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """MHC_SPIN_TIMEOUT_MS=-0 (or spin_timeout_ms=-0.0) turned the bound and the M check off in
    silence: it is a negative value, refused as -5 is; only 0 means off (issue #52, row 14)."""
    for raw in ("-0", "-0.0", "-0e3"):
        monkeypatch.setenv("MHC_SPIN_TIMEOUT_MS", raw)
        refused("core", ValueError, f"MHC_SPIN_TIMEOUT_MS: {SPIN_RANGE}, got -0.0")
    monkeypatch.delenv("MHC_SPIN_TIMEOUT_MS")
    for family in ("core", "dsv41", "glm5"):
        refused(family, ValueError, f"spin_timeout_ms: {SPIN_RANGE}, got -0.0", spin_timeout_ms=-0.0)
    monkeypatch.setenv("MHC_SPIN_TIMEOUT_MS", "0")
    with pytest.raises(BuildStarted):
        op_type("core")[0](**GOOD_CORE)


@pytest.mark.usefixtures("no_build")
def test_top_k_beyond_what_the_finalize_publish_compiles_is_refused() -> None:
    """At top_k = 512 the finalize publish took 66 s to compile (its routes are unrolled)."""
    for family in ("core", "dsv41", "glm5"):
        refused(family, ValueError, "top_k: expected <= 64, got 512 (allowed: [", top_k=512)
        refused(family, ValueError, "top_k: expected <= 64", top_k=65)
    with pytest.raises(BuildStarted):
        op_type("core")[0](**GOOD_CORE, top_k=64)


@pytest.mark.usefixtures("no_build")
@pytest.mark.parametrize("family", ["dsv41", "glm5"])
def test_clusters_beyond_an_int32_kernel_parameter_are_refused(family: str) -> None:
    refused(family, ValueError, "clusters: expected <= 2147483647, got 1099511627776 (allowed: [1, 2147483647])",
            clusters=2**40)  # fmt: skip
    refused(family, TypeError, "clusters: expected an int", clusters=1e3)


@pytest.mark.usefixtures("no_build")
def test_token_thresholds_no_call_can_reach_are_refused() -> None:
    """The native program compares M with them as int64: 2**63 failed after every compile."""
    refused("dsv41", ValueError, "persistent_min_tokens: expected <= 1073741823", persistent_min_tokens=2**63)
    refused("glm5", ValueError, "persistent_min_tokens: expected a threshold <= 1073741823",
            persistent_min_tokens=2**63)  # fmt: skip
    refused("glm5", ValueError, "cluster_tokens: expected a threshold <= 1073741823", cluster_tokens=[(2**63, 2)])


@pytest.mark.usefixtures("no_build")
def test_floats_fp32_cannot_hold_are_refused() -> None:
    """An epsilon of 1e-50 reached the kernels as FP32 zero (no epsilon at all), 1e39 as inf."""
    for value in (1e-50, 1e39):
        message = f"norm_eps: expected a finite value > 0, got {value} (allowed: FP32's normal range"
        refused("dsv41", ValueError, message, norm_eps=value)
        for key in ("rms_eps", "hc_eps", "post_mult", "norm_eps"):
            refused("glm5", ValueError, f"{key}: must be a finite number > 0 in FP32's normal range", **{key: value})


def test_a_call_refuses_an_eps_fp32_cannot_hold() -> None:
    """A call's own norm_eps: finite and > 0 in double, but zero in the kernel's FP32."""
    op, kernels = dsv_op(1)
    x = torch.randn(M, HIDDEN).to(torch.bfloat16)
    for eps in (1e-50, 1e39):
        with pytest.raises(ValueError, match=r"norm_eps: expected a finite value > 0, got .* \(allowed: FP32's normal"):
            op(x, *dsv_args(), eps)
    assert kernels.calls == []


@pytest.mark.usefixtures("no_build")
def test_sizes_and_geometry_the_kernels_cannot_take_are_refused() -> None:
    refused("core", ValueError, "hidden_size: expected <= 65536", hidden_size=2**40)
    refused("core", TypeError, "threads: expected an int", threads=128.0)
    refused("core", TypeError, "lanes: expected an int", lanes=True)


@pytest.mark.usefixtures("no_build")
def test_every_knob_refuses_nan_inf_negatives_huge_and_zero() -> None:
    """Every numeric argument of both ops and the all-reduce, with the values a user gets wrong."""
    nan, inf = float("nan"), float("inf")
    ints = {
        "core": ["hidden_size", "max_num_tokens", "top_k", "threads", "lanes", "publish_threads"],
        "dsv41": ["hidden_size", "hc_mult", "max_num_tokens", "top_k", "cluster_size", "threads", "rank_lanes",
                  "persistent_min_tokens", "clusters", "staged_tokens", "publish_threads"],
        "glm5": ["hidden_size", "max_num_tokens", "sinkhorn_repeat", "top_k", "cluster_size", "publish_threads",
                 "mixes_threads", "persistent_min_tokens", "clusters"],
    }  # fmt: skip
    floats = {"core": ["spin_timeout_ms"], "dsv41": ["spin_timeout_ms", "norm_eps"],
              "glm5": ["spin_timeout_ms", "rms_eps", "hc_eps", "post_mult", "norm_eps"]}  # fmt: skip
    for family, keys in ints.items():
        for key in keys:
            for value in (nan, inf, -1, 2**70, 0.5):
                refused(family, (TypeError, ValueError), key, **{key: value})
    for family, keys in floats.items():
        for key in keys:
            for value in (nan, inf, -1.0, 1e300, 1e-300):
                refused(family, ValueError, key, **{key: value})


@pytest.mark.usefixtures("no_build")
def test_mhc_prebuilt_must_say_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MHC_PREBUILT=false`` meant "use the shipped kernels" (anything but 0 did)."""
    monkeypatch.setenv("MHC_PREBUILT", "false")
    refused("core", ValueError, "MHC_PREBUILT: expected 0 (compile every kernel) or 1 (the default), got 'false'")
    for raw in ("0", "1", ""):
        monkeypatch.setenv("MHC_PREBUILT", raw)
        with pytest.raises(BuildStarted):
            op_type("core")[0](**GOOD_CORE)


def test_a_mailbox_that_cannot_fit_is_refused_before_any_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory check came after every kernel was compiled (and after the pinned error report)."""
    import mhc_core.host.op
    from mhc_core import LamportAllReduce

    compiled: list[Any] = []
    monkeypatch.setattr(mhc_core.host.op, "device_arch", lambda device: "sm_90a")
    # No pinned memory, events or streams here: what the build makes before it compiles.
    monkeypatch.setattr(mhc_core.host.op, "SpinGuard", lambda *args: SimpleNamespace())
    monkeypatch.setattr(mhc_core.host.op, "CallOrder", lambda device: SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 40))
    monkeypatch.setattr(mhc_core.host.op.LamportOp, "_compile", lambda self, spec: compiled.append(spec))
    with pytest.raises(ValueError, match=r"max_num_tokens: a mailbox of .* GiB per rank .* does not fit the 1.00 GiB"):
        LamportAllReduce(hidden_size=8192, max_num_tokens=2**20, device="cuda:0")
    assert compiled == []


# ------------------------------------------------------ lamport_all_reduce's cache
class FakeOp:
    """Stands for ``LamportAllReduce`` in ``lamport_all_reduce``: records how it was built and closed.
    Like no real op, it does not hold its group (so a dropped group's ``id`` can come back)."""

    tp = 1  # no peers: a growth signals and votes nothing

    def __init__(self, *, group: Any, **arguments: Any) -> None:
        self.arguments = arguments
        self.capacity = arguments["max_num_tokens"]
        self.closed = False

    def __call__(self, x: Any, *, out: Any = None) -> FakeOp:
        assert not self.closed, "a closed op was called"
        return self

    def close(self) -> None:
        self.closed = True


class FakeGroup:
    """A group object: the cache must key by it, not by its id."""


@pytest.fixture
def fake_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.host import allreduce

    monkeypatch.setattr(allreduce, "LamportAllReduce", FakeOp)
    monkeypatch.setattr(allreduce, "_OPS", {})
    for variable in ("MHC_SPIN_TIMEOUT_MS", "MHC_TRANSPORT", "MHC_MAILBOX_ALLOCATION"):
        monkeypatch.delenv(variable, raising=False)


def tokens(m: int) -> torch.Tensor:
    return torch.zeros(m, 64, dtype=torch.bfloat16)


@pytest.mark.usefixtures("fake_ops")
def test_a_new_group_never_gets_a_dead_groups_op() -> None:
    from mhc_core import lamport_all_reduce

    group = FakeGroup()
    dead_id, first = id(group), lamport_all_reduce(tokens(2), group=group)
    del group
    gc.collect()
    kept = []  # new groups, until one gets the dropped group's id (unless the cache still holds it)
    for _ in range(10_000):
        new_group = FakeGroup()
        if id(new_group) == dead_id:
            break
        kept.append(new_group)
    assert lamport_all_reduce(tokens(2), group=new_group) is not first, "a new group got a dropped group's op"


@pytest.mark.usefixtures("fake_ops")
def test_every_setting_is_part_of_the_cached_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spin bound and the mailbox allocation were ignored: the first call's op served every later one."""
    from mhc_core import lamport_all_reduce

    group = FakeGroup()
    first = lamport_all_reduce(tokens(2), group=group, spin_timeout_ms=2000.0)
    assert lamport_all_reduce(tokens(2), group=group, spin_timeout_ms=2000.0) is first
    second = lamport_all_reduce(tokens(2), group=group, spin_timeout_ms=5000.0)
    assert second is not first and second.arguments["spin_timeout_ms"] == 5000.0
    assert first.closed, "the op it replaced was dropped without close()"
    third = lamport_all_reduce(tokens(2), group=group, spin_timeout_ms=5000.0, mailbox_allocation="ipc")
    assert third is not second and third.arguments["mailbox_allocation"] == "ipc" and second.closed
    monkeypatch.setenv("MHC_SPIN_TIMEOUT_MS", "7000")
    fourth = lamport_all_reduce(tokens(2), group=group, mailbox_allocation="ipc")
    assert fourth is not third and fourth.arguments["spin_timeout_ms"] == 7000.0 and third.closed
    with pytest.raises(ValueError, match=r"spin_timeout_ms: expected 0 \(off\) or a finite value"):
        lamport_all_reduce(tokens(2), group=group, spin_timeout_ms=float("inf"))
    with pytest.raises(ValueError, match=r"max_num_tokens: expected <= 1073741823"):
        lamport_all_reduce(tokens(2), group=group, max_num_tokens=2**40)
    assert not fourth.closed


@pytest.mark.usefixtures("fake_ops")
def test_a_larger_m_closes_the_op_it_replaces() -> None:
    from mhc_core import lamport_all_reduce

    small = lamport_all_reduce(tokens(2))
    large = lamport_all_reduce(tokens(4))
    assert large is not small and large.capacity == 4 + 1  # one row more: the growth signal's M
    assert small.closed, "the op it replaced was dropped without close()"
    assert lamport_all_reduce(tokens(3)) is large
    from mhc_core import close_lamport_all_reduce

    close_lamport_all_reduce()
    assert large.closed
    assert lamport_all_reduce(tokens(1)) is not large, "a closed op stays cached"


@pytest.fixture
def gloo_world() -> Any:
    """torch.distributed initialised in this process (gloo, one rank), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


@pytest.mark.usefixtures("fake_ops")
def test_a_destroyed_process_groups_ops_are_dropped(gloo_world: Any) -> None:
    from mhc_core import lamport_all_reduce

    dist = gloo_world
    old_group = dist.new_group([0])
    old = weakref.ref(lamport_all_reduce(tokens(2), group=old_group))
    dist.destroy_process_group(old_group)
    del old_group
    lamport_all_reduce(tokens(2), group=dist.new_group([0]))  # the next build forgets the old group
    gc.collect()
    assert old() is None, "the destroyed group's op is still cached"
