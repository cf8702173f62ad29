"""Protocol constants shared by every kernel and reference (pure Python: no DSL import)."""

#: Lamport mailbox generations; two consecutive calls never share one.
LAMPORT_GENERATIONS = 3
#: Index of the stage the next publish writes, in the int32 stage state.
NEXT_STAGE = 0
#: Index of the op's sticky device error word: 0 until a kernel of the op fails (spin bound,
#: unequal M), then the error code. Every kernel reads it; a set word poisons the kernel. It is
#: kept twice, beside each stage word, so that one 8-byte load reads a stage and the error.
ERROR_WORD = 1
#: Index of the stage the last publish wrote (the collective reads it).
ACTIVE_STAGE = 2
#: Index of the error word's copy beside ACTIVE.
ERROR_COPY = 3
#: int32 words of the stage state: NEXT, ERROR, ACTIVE, ERROR (16 bytes).
STAGE_STATE_WORDS = 4

#: BF16 elements per 16-byte fragment, the unit every kernel moves.
VEC_BF16 = 8
WARP_SIZE = 32

#: BF16 negative zero, the "empty slot" sentinel, as one half and as a bf16x2 word.
NEGATIVE_ZERO_BF16 = 0x8000
NEGATIVE_ZERO_BF16_PAIR = 0x80008000
#: Low 15 bits of both halves of a bf16x2 word.
MAGNITUDE_BF16_PAIR = 0x7FFF7FFF
#: FP32 negative zero, the empty sentinel of the side-stream hand-off rows (``mhc_core.device.handoff``).
NEGATIVE_ZERO_F32 = 0x80000000

#: Architectures the kernels compile for, and the compute capability each runs on.
SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

#: Words of the host-mapped error report. The op's failure (a code that poisons it: code, stage,
#: token, fragment, then one word per rank from ERROR_RANKS) and the finalize publish's route report
#: (ROUTE_CODE, ROUTE_TOKEN, ROUTE_INDEX: a debug check that poisons nothing) have words of their
#: own, so that neither report can overwrite or clear the other (issue #32).
ERROR_CODE, ERROR_STAGE, ERROR_TOKEN, ERROR_DETAIL = 0, 1, 2, 3
ROUTE_CODE, ROUTE_TOKEN, ROUTE_INDEX = 4, 5, 6
ERROR_RANKS = 8
ERROR_NONE = 0
ERROR_SPIN_TIMEOUT = 1
ERROR_ROUTE_INDEX = 2
#: A side-stream kernel gave up waiting for a row its main-stream kernel hands off.
ERROR_HANDOFF_TIMEOUT = 3
#: A peer published a different token count M for the same generation (debug check).
ERROR_TOKEN_COUNT = 4
#: The op was closed (``close()`` writes it into the stage state's error words): a CUDA graph that
#: captured it and replays afterwards runs poisoned kernels, which touch no mailbox and write NaN.
ERROR_CLOSED = 5

#: NaN as a bf16x2 word: what a poisoned kernel sums instead of the mailbox's values.
NAN_BF16_PAIR = 0x7FC07FC0
#: Mailbox header: one 16-byte entry per (generation, rank) holding that rank's M (debug check).
HEADER_ENTRY_BYTES = 16
