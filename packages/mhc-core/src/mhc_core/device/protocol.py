"""The Lamport protocol on the device: slot addresses, publishing, polling, re-arming.

Mailbox: ``[LAMPORT_GENERATIONS, tp, capacity, hidden]`` BF16 per rank, every empty
slot BF16 -0. Stage state: int32 ``[NEXT, ACTIVE]``. A publish reads NEXT, writes
its fragment into slot ``[stage, rank, token]`` of every rank's mailbox and records
ACTIVE; the collective reads ACTIVE, polls its own mailbox until no -0 remains,
re-arms what it read and sets NEXT to the following stage. A collective that polls
before its PDL wait reads NEXT instead (``stage_before_wait``): only its own last
arriving cluster moves NEXT on, at its end (``advance_stage_after_all``). Every collective
kernel and every publish kernel is built from these functions, so no kernel
writes the addressing or the spin twice.

Rank lanes: ``lanes`` consecutive threads share a fragment; lane ``l`` polls ranks
``l, l + lanes, l + 2 lanes, ...`` (a lane with no such rank adds zero) and the
lanes are then summed by an xor butterfly. The FP32 summation tree is therefore
fixed by (tp, lanes) alone and is the same on every rank;
``mhc_core.reference.tp_sum`` builds the same tree.

Sticky errors: the stage state's error word is 0 until a kernel of the op fails (a spin
bound expired, or a peer published another M). It is kept beside both stage words, so the
one 8-byte load of a stage reads it too (``read_state``: no extra request, and no extra
traffic on that one hot line), and an empty poll round with the bound on reads it again (a
failure elsewhere in the grid). A set word poisons the kernel: it does not poll, sums NaN
instead of the slots (so every output it derives is NaN), re-arms nothing and leaves the
stage where it is. A publish that reads it set stores nothing. The op is then unusable
until it is rebuilt on every rank.

Token counts (with the spin bound on): the first thread of a publish writes its M into
the mailbox header entry ``[stage, rank]`` of every rank (``HEADER_ENTRY_BYTES`` each,
after the slots; empty entries hold the BF16 -0 sentinel like the slots), and one thread
of each collective polls every rank's entry beside its slots, compares, and re-arms them.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Uint32

from ..constants import (
    ACTIVE_STAGE,
    ERROR_CODE,
    ERROR_COPY,
    ERROR_DETAIL,
    ERROR_RANKS,
    ERROR_SPIN_TIMEOUT,
    ERROR_STAGE,
    ERROR_TOKEN,
    ERROR_TOKEN_COUNT,
    ERROR_WORD,
    HEADER_ENTRY_BYTES,
    LAMPORT_GENERATIONS,
    NAN_BF16_PAIR,
    NEXT_STAGE,
    VEC_BF16,
)
from . import ptx
from .configs import STORE_KINDS, STORE_MULTICAST, STORE_MULTICAST_LOCAL, STORE_UNICAST  # noqa: F401 (re-exported)

BF16_BYTES = 2


def rank_waves(tp: int, lanes: int) -> int:
    """Ranks each lane polls (the last wave may be partial)."""
    return -(-tp // lanes)


@cute.jit
def slot_bytes(
    stage: Uint32,
    rank: Int32,
    token: Int32,
    fragment: Int32,
    tp: cutlass.Constexpr[int],
    capacity: Int32,
    hidden: cutlass.Constexpr[int],
) -> Int64:
    """Byte offset of a fragment of slot ``[stage, rank, token]`` in a mailbox."""
    element = ((Int64(stage) * tp + Int64(rank)) * Int64(capacity) + Int64(token)) * hidden + Int64(fragment) * VEC_BF16
    return element * BF16_BYTES


@cute.jit
def state_address(stage_state: cute.Tensor, index: cutlass.Constexpr[int]) -> Int64:
    return stage_state.iterator.toint() + Int64(index * 4)


@cute.jit
def read_state(stage_state: cute.Tensor, index: cutlass.Constexpr[int]) -> tuple:
    """``(stage, poisoned)``: stage word ``index`` and the error word beside it, in one load."""
    stage, error = ptx.load_volatile_u32x2(state_address(stage_state, index))
    return stage, error != Uint32(0)


@cute.jit
def is_poisoned(state: Int64) -> Boolean:
    """Whether a kernel of this op failed (``state``: the stage state's address), read now."""
    return ptx.load_volatile_u32(state + Int64(ERROR_WORD * 4)) != Uint32(0)


@cute.jit
def set_error(state: Int64, code: cutlass.Constexpr[int]) -> None:
    """Poison the op: both copies of its error word (every later kernel reads one)."""
    ptx.store_u32(state + Int64(ERROR_WORD * 4), Uint32(code))
    ptx.store_u32(state + Int64(ERROR_COPY * 4), Uint32(code))


@cute.jit
def begin_publish(stage_state: cute.Tensor, leader: Boolean) -> tuple:
    """``(stage, poisoned)``: the stage this publish writes (the leader records it as ACTIVE)
    and whether the op is poisoned."""
    stage, poisoned = read_state(stage_state, NEXT_STAGE)
    if leader:
        ptx.store_u32(state_address(stage_state, ACTIVE_STAGE), stage)
    return stage, poisoned


# ------------------------------------------------------------ direct read (tp = 1)
@cute.jit
def reads_x(direct: Int32, tp: cutlass.Constexpr[int]) -> Boolean:
    """Whether this launch reads the sublayer output ``x`` itself instead of polling the mailbox:
    only at tp = 1, where there is nothing to all-reduce and the op launches no publish (a
    compile-time False at tp > 1, so those kernels have no direct path at all)."""
    from_x = Boolean(False)
    if cutlass.const_expr(tp == 1):
        from_x = direct != Int32(0)
    return from_x


@cute.jit
def load_x_raw(x: cute.Pointer, token: Int32, column: Int64, hidden: cutlass.Constexpr[int]) -> cute.TensorSSA:
    """A fragment of ``x[token]`` as stored: pass it through ``ptx.sanitize_negative_zero`` before
    use (``load_x``). Kept apart so that a prologue can issue it without waiting for it."""
    return ptx.load_u32x4(x.toint() + (Int64(token) * hidden + column) * 2)


@cute.jit
def load_x(x: cute.Pointer, token: Int32, column: Int64, hidden: cutlass.Constexpr[int]) -> cute.TensorSSA:
    """A fragment of ``x[token]`` with -0 as +0: the words a publish would have written, so the
    boundary's result is bit-identical to the mailbox path's (whose tree adds them to +0)."""
    return ptx.sanitize_negative_zero(load_x_raw(x, token, column, hidden))


@cute.jit
def header_bytes(
    stage: Uint32, rank: Int32, tp: cutlass.Constexpr[int], capacity: Int32, hidden: cutlass.Constexpr[int]
) -> Int64:
    """Byte offset of the header entry ``[stage, rank]``: after every generation's slots."""
    slots_end = slot_bytes(Uint32(LAMPORT_GENERATIONS), Int32(0), Int32(0), Int32(0), tp, capacity, hidden)
    return slots_end + (Int64(stage) * tp + Int64(rank)) * HEADER_ENTRY_BYTES


@cute.jit
def encode_count(m: Int32) -> Uint32:
    """M as a header word: ``2 M + 1`` has an odd low half and, for M < 2^30, a high half
    below 0x8000, so it never reads as the -0 sentinel."""
    return (Uint32(m) << Uint32(1)) | Uint32(1)


@cute.jit
def publish_count(
    m: Int32,
    stage: Uint32,
    rank: Int32,
    destinations: cute.Tensor,
    store: cutlass.Constexpr[str],
    tp: cutlass.Constexpr[int],
    capacity: Int32,
    hidden: cutlass.Constexpr[int],
) -> None:
    """One thread: this rank's M into header entry ``[stage, rank]`` of every rank's mailbox."""
    words = cute.make_rmem_tensor(cute.make_layout((4,)), Uint32)
    words.fill(encode_count(m))
    publish_fragment(words.load(), header_bytes(stage, rank, tp, capacity, hidden), destinations, store, tp)


@cute.jit
def load_destinations(destinations: cute.Tensor, count: cutlass.Constexpr[int]) -> cute.Tensor:
    """The destination table in registers (read before the PDL wait: it never changes)."""
    bases = cute.make_rmem_tensor(cute.make_layout((count,)), Int64)
    for k in cutlass.range_constexpr(count):
        bases[k] = destinations[k]
    return bases


@cute.jit
def publish_fragment(
    words: cute.TensorSSA,
    offset: Int64,
    destinations: cute.Tensor,
    store: cutlass.Constexpr[str],
    tp: cutlass.Constexpr[int],
) -> None:
    """Store one sanitised fragment at ``offset`` of every rank's mailbox.

    ``destinations`` (registers, from ``load_destinations``) holds the peers'
    mailbox bases (unicast, own rank included), or one address: the multicast
    base, or the local base for the debug variant.
    """
    if cutlass.const_expr(store == STORE_UNICAST):
        for peer in cutlass.range_constexpr(tp):
            ptx.store_u32x4(destinations[peer] + offset, words)
    elif cutlass.const_expr(store == STORE_MULTICAST):
        ptx.multimem_store_bf16x8(destinations[0] + offset, words)
    else:
        ptx.store_u32x4(destinations[0] + offset, words)


@cute.jit
def scatter_fragment(
    words: cute.TensorSSA,
    stage: Uint32,
    rank: Int32,
    token: Int32,
    fragment: Int32,
    destinations: cute.Tensor,
    tp: cutlass.Constexpr[int],
    capacity: Int32,
    hidden: cutlass.Constexpr[int],
) -> None:
    """Two-shot stage 1: store fragment ``fragment`` of the row into its owner's reduce-scatter mailbox
    only, at slot ``[stage, rank, token]`` of that ``[3, tp, capacity, hidden / tp]`` mailbox. The
    owner of slice ``j`` (``hidden / tp`` columns) is rank ``j``. The table is walked with compile-time
    indices (a register array indexed at run time would go to local memory): one store is predicated on."""
    slice_fragments = hidden // VEC_BF16 // tp
    owner = fragment // slice_fragments
    offset = slot_bytes(stage, rank, token, fragment - owner * slice_fragments, tp, capacity, hidden // tp)
    for peer in cutlass.range_constexpr(tp):
        if owner == Int32(peer):
            ptx.store_u32x4(destinations[peer] + offset, words)


@cute.jit
def active_stage(stage_state: cute.Tensor) -> tuple:
    """``(stage, poisoned)``: the stage the publish before this collective wrote (read after
    the PDL wait), and whether the op is poisoned."""
    return read_state(stage_state, ACTIVE_STAGE)


@cute.jit
def advance_stage(stage_state: cute.Tensor, stage: Uint32, leader: Boolean) -> None:
    """Once per launch: the next publish uses the following generation."""
    if leader:
        ptx.store_u32(state_address(stage_state, NEXT_STAGE), (stage + Uint32(1)) % Uint32(LAMPORT_GENERATIONS))


@cute.jit
def stage_before_wait(stage_state: cute.Tensor) -> tuple:
    """``(stage, poisoned)``: the stage the publish before this collective writes, readable
    before the PDL wait: NEXT. The previous collective moved it on before it completed, which
    that publish waited for; this one moves it only after every cluster has read it
    (``advance_stage_after_all``). An earlier kernel's failure is visible by then too."""
    return read_state(stage_state, NEXT_STAGE)


@cute.jit
def advance_stage_after_all(
    stage_state: cute.Tensor, arrivals: cute.Tensor, stage: Uint32, clusters: Int32, leader: Boolean
) -> None:
    """Once per cluster, at its end, after the PDL wait: count the cluster in (``arrivals``, an
    int32 that starts at 0); the last one resets the count and sets NEXT to the following stage.

    Each cluster read NEXT and finished polling before it arrives, and the PDL wait means the
    publish (which read NEXT before storing) has completed: no reader of this stage is left.
    The next publish reads NEXT after this grid has completed.
    """
    if leader:
        count = arrivals.iterator.toint()
        if ptx.arrive_u32(count) == Uint32(clusters - 1):
            ptx.store_u32(count, Uint32(0))
            ptx.store_u32(state_address(stage_state, NEXT_STAGE), (stage + Uint32(1)) % Uint32(LAMPORT_GENERATIONS))


@cute.jit
def spin_clock(started: Int64, spin_limit_ns: Int64) -> tuple:
    """One round of a bounded spin that found nothing yet: ``(started, expired)``. The clock
    starts at the first such round (``started == 0``), so launch delays do not count."""
    now = cute.arch.globaltimer()
    expired = Boolean(False)
    if started == Int64(0):
        started = now
    elif now - started > spin_limit_ns:
        expired = Boolean(True)
    return started, expired


# ------------------------------------------------------------ argument bundles
# Trace-time groups of a poll's arguments. Reading a field emits nothing, so a function that
# takes a bundle traces exactly as it did with the separate values (``tools.compile_presets
# --ptx-digest``). Frozen: the DSL passes a frozen dataclass into a dynamic region read-only
# instead of carrying it. Build one in the call, or earlier from finished values only: an
# expression evaluated for a field (``stage_state.iterator.toint()``) emits its operations where it
# is written, and a bundle built before a dynamic loop holds the values from before it, not those
# the loop carries.
@dataclass(frozen=True)
class MailboxView:
    """One stage of this rank's mailbox: everything a slot's or header entry's address is
    made of (``slot_address``, ``header_address``)."""

    base: Int64  # this rank's mailbox
    stage: Uint32
    tp: int  # compile time
    capacity: Int32
    hidden: int  # compile time


@dataclass(frozen=True)
class Slots:
    """Which slots a lane polls or re-arms: ``tokens`` (compile time) of them, slot ``t`` at fragment
    ``fragment + t * fragment_step`` of token ``min(first_token + t * token_step, last_token)``:
    several tokens at one fragment (the default steps), or one token's consecutive fragments
    (``token_step=0, fragment_step=1``)."""

    first_token: Int32
    last_token: Int32
    fragment: Int32
    tokens: int = 1
    token_step: int = 1
    fragment_step: int = 0


@dataclass(frozen=True)
class RankLane:
    """This thread's share of a poll: lane ``lane`` of ``lanes`` (compile time) polls ranks ``lane,
    lane + lanes, ...``; an inactive thread polls nothing (its slots read as zero)."""

    lane: Int32
    lanes: int
    active: Boolean


@dataclass(frozen=True)
class SpinBound:
    """The bound on a poll's spin and where a failure is reported: ``limit_ns`` of the global timer
    (0: spin for ever), the host-mapped ``error_flag`` words, and ``state``, the stage state's
    address, whose error word poisons every later kernel of the op."""

    limit_ns: Int64
    error_flag: Int64
    state: Int64


@dataclass(frozen=True)
class TokenCountCheck:
    """The check that every rank published the same M (needs the spin bound on): ``counts`` (compile
    time) turns it on for the kernel, ``counter`` picks the one thread that polls the header
    entries and compares them with ``m``."""

    counts: bool = False
    counter: Boolean = False
    m: Int32 = 0


#: No token-count check (``poll_slots``' default).
NO_COUNT_CHECK = TokenCountCheck()


@cute.jit
def slot_address(mailbox: MailboxView, rank: Int32, token: Int32, fragment: Int32) -> Int64:
    """Address of a fragment of slot ``[mailbox.stage, rank, token]``."""
    return mailbox.base + slot_bytes(mailbox.stage, rank, token, fragment, mailbox.tp, mailbox.capacity, mailbox.hidden)


@cute.jit
def header_address(mailbox: MailboxView, rank: Int32) -> Int64:
    """Address of header entry ``[mailbox.stage, rank]``."""
    return mailbox.base + header_bytes(mailbox.stage, rank, mailbox.tp, mailbox.capacity, mailbox.hidden)


@cute.jit
def poll_slots(
    kept: cute.Tensor,
    mailbox: MailboxView,
    slots: Slots,
    lane: RankLane,
    spin: SpinBound,
    poisoned: Boolean,
    check: TokenCountCheck = NO_COUNT_CHECK,
) -> Boolean:
    """Poll this lane's ranks for ``slots.tokens`` slots until no -0 remains; return ``poisoned``.

    ``kept[t, w, :]`` receives the 4 words of slot ``t`` (``Slots``) from rank ``w * lanes + lane``
    (zeros where that rank does not exist or the thread is inactive). ``poisoned`` is what the
    kernel's stage read found (``read_state``): then nothing is polled. With ``spin.limit_ns > 0``
    every empty round reads the op's error word again (``spin.state``; another thread may have
    failed) and the loop gives up after that many nanoseconds of the global timer, records the
    ranks still missing in the host-mapped ``spin.error_flag`` and sets the error word: the kernel
    finishes instead of hanging, and every later kernel of the op is poisoned. Poisoned, ``kept`` is
    filled with NaN and the result is True.

    ``check.counts`` (compile time) with ``check.counter`` set on one thread: that thread also polls
    every rank's header entry of this stage, compares the M it holds with ``check.m``, reports a
    mismatch (``ERROR_TOKEN_COUNT``: the peers' M per rank) and re-arms the entries.
    """
    # Unpacked once: the names every use below had as parameters (a field read emits nothing).
    tp = mailbox.tp
    first_token, last_token, fragment = slots.first_token, slots.last_token, slots.fragment
    tokens, token_step, fragment_step = slots.tokens, slots.token_step, slots.fragment_step
    lanes, active = lane.lanes, lane.active
    spin_limit_ns, state = spin.limit_ns, spin.state
    counts = check.counts
    waves = rank_waves(tp, lanes)
    counter = Boolean(check.counter)
    kept.fill(Uint32(0))
    poisoned = Boolean(poisoned)
    dirty = active & (poisoned == Boolean(False))
    if cutlass.const_expr(counts):
        dirty = (active | counter) & (poisoned == Boolean(False))
    started = Int64(0)
    seen = cute.make_rmem_tensor(cute.make_layout((tp,)), Uint32)
    seen.fill(Uint32(0))
    counted = counter == Boolean(False)
    while dirty:
        dirty = Boolean(False)
        for t in cutlass.range_constexpr(tokens):
            token = cutlass.min(first_token + t * token_step, last_token)
            for wave in cutlass.range_constexpr(waves):
                source = lane.lane + wave * lanes
                polls = source < tp
                if cutlass.const_expr(counts):
                    polls = polls & active  # only the counter thread loops without a slot of its own
                if polls:
                    words = ptx.load_volatile_u32x4(slot_address(mailbox, source, token, fragment + t * fragment_step))
                    dirty = dirty | ptx.has_negative_zero(words)
                    kept[t, wave, None].store(words)
        if cutlass.const_expr(counts):  # noqa: SIM102 (a compile-time branch stands alone in the DSL)
            if counted == Boolean(False):
                arrived = Boolean(True)
                for rank in cutlass.range_constexpr(tp):
                    words = ptx.load_volatile_u32x4(header_address(mailbox, Int32(rank)))
                    arrived = arrived & (ptx.has_negative_zero(words) == Boolean(False))
                    seen[rank] = ptx.element(words, 0)
                counted = arrived
                dirty = dirty | (arrived == Boolean(False))
        if dirty & (spin_limit_ns > Int64(0)):
            # An empty round: a failure elsewhere in the grid (a timeout, an unequal M) ends it too.
            poisoned = is_poisoned(state)
            started, expired = spin_clock(started, spin_limit_ns)
            if expired:
                _report_timeout(kept, mailbox, slots, lane, spin)
                set_error(state, ERROR_SPIN_TIMEOUT)
                poisoned = Boolean(True)
            dirty = dirty & (poisoned == Boolean(False))
    if cutlass.const_expr(counts):  # noqa: SIM102 (a compile-time branch stands alone in the DSL)
        if counter & counted & (poisoned == Boolean(False)):
            _check_counts(seen, mailbox, check.m, spin)
    if poisoned:
        kept.fill(Uint32(NAN_BF16_PAIR))
    return poisoned


@cute.jit
def _check_counts(seen: cute.Tensor, mailbox: MailboxView, m: Int32, spin: SpinBound) -> None:
    """Compare every rank's published M (``seen``, header words) with ``m``; re-arm the entries.
    A mismatch records each differing rank's M in its rank word, then this M and the code."""
    error_flag = spin.error_flag
    mismatch = Boolean(False)
    for rank in cutlass.range_constexpr(mailbox.tp):
        ptx.store_sentinel_u32x4(header_address(mailbox, Int32(rank)))
        peer_m = seen[rank] >> Uint32(1)
        if peer_m != Uint32(m):
            ptx.store_system_u32(error_flag + Int64(ERROR_RANKS * 4) + Int64(rank * 4), peer_m)
            mismatch = Boolean(True)
    if mismatch:
        ptx.store_system_u32(error_flag + Int64(ERROR_STAGE * 4), mailbox.stage)
        ptx.store_system_u32(error_flag + Int64(ERROR_TOKEN * 4), Uint32(m))
        ptx.store_system_u32(error_flag + Int64(ERROR_CODE * 4), Uint32(ERROR_TOKEN_COUNT))
        set_error(spin.state, ERROR_TOKEN_COUNT)


@cute.jit
def _report_timeout(kept: cute.Tensor, mailbox: MailboxView, slots: Slots, lane: RankLane, spin: SpinBound) -> None:
    """Mark every rank whose slot still holds -0, then the stage, (first) token, fragment and code."""
    error_flag = spin.error_flag
    for t in cutlass.range_constexpr(slots.tokens):
        for wave in cutlass.range_constexpr(rank_waves(mailbox.tp, lane.lanes)):
            source = lane.lane + wave * lane.lanes
            if source < mailbox.tp:  # noqa: SIM102 (a rank that does not exist has no slot to inspect)
                if ptx.has_negative_zero(kept[t, wave, None].load()):
                    ptx.store_system_u32(error_flag + Int64(ERROR_RANKS * 4) + Int64(source) * 4, Uint32(1))
    ptx.store_system_u32(error_flag + Int64(ERROR_STAGE * 4), mailbox.stage)
    ptx.store_system_u32(error_flag + Int64(ERROR_TOKEN * 4), Uint32(slots.first_token))
    ptx.store_system_u32(error_flag + Int64(ERROR_DETAIL * 4), Uint32(slots.fragment))
    ptx.store_system_u32(error_flag + Int64(ERROR_CODE * 4), Uint32(ERROR_SPIN_TIMEOUT))


@cute.jit
def lane_sum(kept: cute.Tensor, t: cutlass.Constexpr[int], waves: cutlass.Constexpr[int]) -> cute.TensorSSA:
    """FP32 sum of this lane's ranks for token ``t``, in wave order from +0."""
    total = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
    total.fill(Float32(0.0))
    for wave in cutlass.range_constexpr(waves):
        total.store(total.load() + ptx.words_to_f32x8(kept[t, wave, None].load()))
    return total.load()


@cute.jit
def rank_tree_sum(
    kept: cute.Tensor, t: cutlass.Constexpr[int], tp: cutlass.Constexpr[int], lanes: cutlass.Constexpr[int]
) -> cute.TensorSSA:
    """Every rank's fragment of slot ``t`` (``kept[t, rank, :]``, polled by one thread with
    ``lanes=1``) summed in the tree of ``lanes`` rank lanes: each lane's ranks in wave order
    from +0 (``lane_sum``), then the lanes pairwise (``sum_over_lanes``). Bit-identical to
    that split: the skipped zero terms of missing ranks add +0 to a sum that is never -0.
    """
    partials = []
    for lane in cutlass.range_constexpr(lanes):
        total = cute.make_rmem_tensor(cute.make_layout((VEC_BF16,)), Float32)
        total.fill(Float32(0.0))
        for wave in cutlass.range_constexpr(rank_waves(tp, lanes)):
            if cutlass.const_expr(lane + wave * lanes < tp):
                total.store(total.load() + ptx.words_to_f32x8(kept[t, lane + wave * lanes, None].load()))
        partials.append(total.load())
    return _pairwise_sum(partials)


def _pairwise_sum(values: list) -> cute.TensorSSA:
    """``((v0 + v1) + (v2 + v3)) ...``: lane 0's view of the xor butterfly (plain Python, unrolled)."""
    if len(values) == 1:
        return values[0]
    return _pairwise_sum([values[2 * k] + values[2 * k + 1] for k in range(len(values) // 2)])


@cute.jit
def sum_over_lanes(values: cute.Tensor, lanes: cutlass.Constexpr[int]) -> None:
    """Xor butterfly over ``lanes`` (a power of two) consecutive lanes; each ends with the total.

    The warp must be converged (lanes leave the poll at different times: call
    ``cute.arch.sync_warp()`` first).
    """
    for step in cutlass.range_constexpr(lanes.bit_length() - 1):
        for k in cutlass.range_constexpr(VEC_BF16):
            values[k] = values[k] + cute.arch.shuffle_sync_bfly(values[k], offset=1 << step, mask=-1, mask_and_clamp=31)


@cute.jit
def poll_and_sum(
    total: cute.Tensor,
    mailbox: MailboxView,
    slots: Slots,
    lane: RankLane,
    spin: SpinBound,
    poisoned: Boolean,
    check: TokenCountCheck = NO_COUNT_CHECK,
) -> Boolean:
    """One token's fragment from every rank, summed: ``total`` (8 FP32) holds the tree sum in
    every lane of the group (``poll_slots`` of one slot, then the lanes' sums, then the butterfly;
    NaN and True returned when poisoned)."""
    waves = rank_waves(mailbox.tp, lane.lanes)
    kept = cute.make_rmem_tensor(cute.make_layout((1, waves, 4), stride=(waves * 4, 4, 1)), Uint32)
    poisoned = poll_slots(kept, mailbox, slots, lane, spin, poisoned, check)
    # Lanes leave the poll at different times; the butterfly needs the warp converged.
    cute.arch.sync_warp()
    total.store(lane_sum(kept, 0, waves))
    sum_over_lanes(total, lane.lanes)
    return poisoned


@cute.jit
def rearm_slots(mailbox: MailboxView, slots: Slots, lane: RankLane) -> None:
    """Write the -0 sentinel back into every slot this lane polled (``poll_slots``' slots)."""
    if lane.active:
        for t in cutlass.range_constexpr(slots.tokens):
            token = cutlass.min(slots.first_token + t * slots.token_step, slots.last_token)
            for wave in cutlass.range_constexpr(rank_waves(mailbox.tp, lane.lanes)):
                source = lane.lane + wave * lane.lanes
                if source < mailbox.tp:
                    ptx.store_sentinel_u32x4(
                        slot_address(mailbox, source, token, slots.fragment + t * slots.fragment_step)
                    )
