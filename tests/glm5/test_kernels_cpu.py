"""The GLM-5.3 kernels compile without a GPU; what their PTX must contain (sm_90a and sm_100a)."""

from __future__ import annotations

import pytest

from tests.core.test_kernels_cpu import compiled
from tests.ptx_checks import count, polls_volatile_in_loop

ARCHS = ("sm_90a", "sm_100a")
MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
BULK_COPY = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"


def boundary(arch: str, tokens: int, tp: int = 1, hidden: int = 4096, persistent: bool = False):
    """The kernel an op serving ``tokens`` per cluster compiles (``config.grouped_kernel_path``), or
    its persistent boundary."""
    from mhc_core.host.binaries.compiler import kernel_from_spec
    from mhc_glm5.config import PERSISTENT_KERNEL, grouped_kernel_path

    config = {
        "hidden": hidden, "tp": tp, "cluster_size": 8, "rms_eps": 1e-6, "hc_eps": 1e-6, "norm_eps": 1e-5,
        "mixed_fma": arch != "sm_90a", "tokens": tokens, "persistent": persistent,
    }  # fmt: skip
    path = "mhc_glm5.boundary:BoundaryKernel" if tokens == 1 else grouped_kernel_path(tokens)
    if persistent:
        path = PERSISTENT_KERNEL
    return kernel_from_spec(path, config)


def check_staged_fn(ptx: str, stagings: int = 1) -> None:
    """fn (and, in the tensor-core kernel, the residual streams) staged by one bulk copy per
    row: issued once per thread (unrolled once), completed on an mbarrier per staging that the
    kernel waits on (``try_wait`` retried in the DSL's asm loop)."""
    assert count(ptx, BULK_COPY) == stagings
    assert count(ptx, "mbarrier.init.shared") == stagings and count(ptx, "expect_tx") == stagings
    assert count(ptx, "mbarrier.try_wait.parity") == stagings


def check_protocol(ptx: str, polls: int = 1) -> None:
    """Every boundary: the stage read once (with the error word beside it), the poll spinning on
    volatile loads under the time bound before the PDL wait (which the kernels put before their
    output stores), one trigger, the stage moved on by the last arriving cluster, and the raw mixes
    handed off with no fence (``mhc_core.device.handoff``). An empty poll round reads the error word again."""
    assert polls_volatile_in_loop(ptx)
    assert count(ptx, "ld.volatile.global.v2.u32") == 1, "the stage and the error word, read once"
    assert count(ptx, "ld.volatile.global.u32") == polls, "the error word again, in each poll's empty rounds"
    assert count(ptx, "griddepcontrol.wait") == 2, "one in the no-prefetch / direct branch, one before the outputs"
    assert ptx.index("ld.volatile.global.v4.u32") < ptx.rindex("griddepcontrol.wait"), "the poll precedes the wait"
    assert count(ptx, "griddepcontrol.launch_dependents") == 1
    assert count(ptx, "atom.acq_rel.gpu.global.add.u32") == 1
    assert ptx.rindex("griddepcontrol.wait") < ptx.index("atom.acq_rel.gpu"), "arrivals after the wait"
    assert count(ptx, "%globaltimer") >= 1
    assert count(ptx, ".release.gpu") == 0 and count(ptx, "membar") == 0 and count(ptx, "fence.acq_rel") == 0


def test_one_device_entry_follows_the_signature() -> None:
    """The boundary kernels share one device entry: it takes ``boundary_signature``'s parameters in
    order (but the launch's own: the stream, and ``clusters``, which sizes the persistent grid) and
    hands them to each class's ``body`` as ``BoundaryArgs``, built positionally, so the names must
    line up."""
    import dataclasses
    import inspect

    from mhc_glm5.boundary import (
        BoundaryArgs,
        BoundaryKernel,
        BoundaryOutputs,
        Exchange,
        MixInputs,
        SublayerOutput,
        boundary_signature,
    )
    from mhc_glm5.grouped import GroupBoundaryKernel
    from mhc_glm5.grouped_mma import MmaGroupBoundaryKernel

    names = [param.name for param in boundary_signature()]
    assert list(inspect.signature(BoundaryKernel.__call__).parameters)[1:] == names
    assert names[-3:] == ["clusters", "m", "stream"], "clusters and the stream: the launch's alone"
    device = [name for name in names if name not in ("clusters", "stream")]
    assert list(BoundaryArgs._fields) == device
    # The device entry takes them in bundles (issue #50), whose fields are those names in order;
    # the FP8 outputs (issue #33) follow, None in a BF16 kernel (``Fp8Outputs`` to ``body``).
    kernel_params = list(inspect.signature(BoundaryKernel.kernel).parameters)[1:]
    assert kernel_params == ["inputs", "outputs", "sublayer", "exchange", "m", "layer_input_q", "layer_input_scales"]
    bundles = (MixInputs, BoundaryOutputs, SublayerOutput, Exchange)
    assert [field.name for kind in bundles for field in dataclasses.fields(kind)] + ["m"] == device
    from mhc_glm5.persistent import PersistentBoundaryKernel

    kinds = (BoundaryKernel, GroupBoundaryKernel, MmaGroupBoundaryKernel, PersistentBoundaryKernel)
    assert all(kind.kernel is BoundaryKernel.kernel for kind in kinds)
    assert len({kind.body for kind in kinds}) == 4


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens,tp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 4)])
def test_cuda_core_boundaries(arch: str, tokens: int, tp: int) -> None:
    """The one-token and CUDA-core grouped kernels: the GEMV's mixed-precision dot is
    ``fma.rn.f32.bf16`` on sm_100+, the exact unpack + ``fma.rn.f32`` on sm_90a."""
    ptx = compiled(boundary(arch, tokens, tp), arch)
    check_protocol(ptx)
    if tokens == 1:
        check_staged_fn(ptx)
        from mhc_glm5.config import SM_SHARED_BYTES

        # Two CTAs of the one-token kernel never share an SM (each also reserves 1 KiB).
        assert 2 * (boundary(arch, tokens).shared_bytes() + 1024) > SM_SHARED_BYTES
        # The 25-value reduction is one warp reduce-scatter (31 shuffles, not 125); the rest: the
        # rank-lane and collapse butterflies (2 x 2 x 8) and the 1-value reduction (5).
        assert count(ptx, "shfl.sync") <= 31 + 32 + 5 + 3
    else:
        assert count(ptx, BULK_COPY) == 0, "the CUDA-core grouped kernel keeps fn in registers"
    if arch == "sm_90a":
        assert count(ptx, "fma.rn.f32.bf16") == 0
    else:
        assert count(ptx, "fma.rn.f32.bf16") >= 25 * 8
    assert count(ptx, "mma.sync") == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tokens,tp", [(8, 1), (16, 1), (16, 8)])
def test_tensor_core_boundary(arch: str, tokens: int, tp: int) -> None:
    """4 fragments per warp x 3 n-tiles x 2 k-halves of m16n8k16; the staging is asynchronous:
    fn and the residual streams by bulk copies, post / comb by 4-byte copies."""
    ptx = compiled(boundary(arch, tokens, tp), arch)
    check_protocol(ptx, polls=tokens // 8)  # one poll per half of 8 tokens
    check_staged_fn(ptx, stagings=2)
    assert count(ptx, MMA) == 4 * 3 * 2
    assert count(ptx, "cp.async.cg.shared.global") == 0
    assert count(ptx, "cp.async.ca.shared.global") >= 1 and count(ptx, "cp.async.wait_group") == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", (1, 8))
def test_persistent_boundary(arch: str, tp: int) -> None:
    """The tensor-core kernel looping over groups of 8, software pipelined: the first group's work
    before the loop and each later group's in it (the group's front traced twice: its poll, its
    next group's copies, its waits, post-mix and MMA), then the last group's collapse after it. fn
    staged once; three stream buffers, each on its own mbarrier waited on by parity; post / comb by
    4-byte copies one group ahead (one cp.async group per front, real or empty); one cluster barrier
    per group in the loop (values and the group before's squares), one before it and one after; the
    stage moved on once."""
    import re

    ptx = compiled(boundary(arch, 8, tp, persistent=True), arch)
    assert polls_volatile_in_loop(ptx)
    assert count(ptx, "ld.volatile.global.v2.u32") == 1, "the stage and the error word, read once"
    assert count(ptx, "ld.volatile.global.u32") == 2, "the error word again: the poll of each front"
    assert count(ptx, BULK_COPY) == 4, "fn, the first group's streams, the next group's (each front)"
    assert count(ptx, "mbarrier.init.shared") == 4
    # Armed before the CTA barrier their copies follow (every warp issues some): the three stream
    # buffers' first phases and fn in the prologue, each later phase after the collapse frees it.
    assert count(ptx, "expect_tx") == 5
    assert count(ptx, "mbarrier.try_wait.parity") == 4, "this group's streams and fn, in each front"
    assert count(ptx, MMA) == 2 * 4 * 3 * 2
    assert count(ptx, "cp.async.wait_group \t1;") == 2 and count(ptx, "cp.async.commit_group") == 5
    assert count(ptx, "fence.proxy.async.shared::cta") == 1, "the collapsed buffer, before the next copies"
    assert count(ptx, "barrier.cluster.arrive") == 3 and count(ptx, "barrier.cluster.wait") == 3
    # The PDL wait: in the no-prefetch / direct branch, and before each collapse's output stores.
    assert count(ptx, "griddepcontrol.wait") == 3 and count(ptx, "griddepcontrol.launch_dependents") == 2
    assert count(ptx, "atom.acq_rel.gpu.global.add.u32") == 1, "the cluster arrives once"
    assert ptx.rindex("griddepcontrol.wait") < ptx.index("atom.acq_rel.gpu"), "arrivals after the wait"
    assert count(ptx, ".release.gpu") == 0 and count(ptx, "membar") == 0 and count(ptx, "fence.acq_rel") == 0
    assert re.search(r"mov\.u32\s+%r\d+, %nctaid\.x;", ptx), "the loop's stride: the grid"


def test_persistent_boundary_geometry() -> None:
    """Three buffers of 8 tokens' streams, two of mix inputs and two halves of the peers' slots beside
    fn; the op launches min(groups, clusters) clusters; only groups of 8 loop."""
    import dataclasses

    from mhc_glm5.config import MAX_SHARED_BYTES, SM_SHARED_BYTES, persistent_clusters, persistent_shared_bytes
    from mhc_glm5.persistent import PersistentBoundaryKernel

    kernel = boundary("sm_90a", 8, persistent=True)
    fn = 96 * (64 * 16 + 16) + 8 + 128
    staged = 3 * (8 + 8 * 4 * (64 * 16 + 16))  # three groups' streams, each with its mbarrier
    reductions = 8 * (2 * 20 + (16 + 2 * 8 + 1) * 25 + 16 + 2 * 8) * 4  # two mix buffers, two peer halves
    assert kernel.shared_bytes() == persistent_shared_bytes(4096, 8) == fn + staged + reductions <= MAX_SHARED_BYTES
    assert 2 * kernel.shared_bytes() > SM_SHARED_BYTES, "one CTA per SM: persistent_clusters counts so"
    assert persistent_clusters(132, 8) == 15 and persistent_clusters(4, 8) == 1
    sixteen = dataclasses.replace(boundary("sm_90a", 16).config, persistent=True)
    with pytest.raises(ValueError, match="tokens: the persistent boundary loops over groups of 8"):
        PersistentBoundaryKernel(sixteen)


def test_tensor_core_boundary_geometry() -> None:
    """Twice the threads of the other kernels (a warp per 4 fragments); shared memory as sized."""
    from mhc_glm5.config import MAX_SHARED_BYTES, mma_shared_bytes, mma_threads

    kernel = boundary("sm_90a", 16)
    assert kernel.block_threads() == mma_threads(4096, 8) == 2 * kernel.config.threads == 512
    fn = 96 * (64 * 16 + 16) + 8 + 128  # (row, stream) chunks padded by 4 words, the mbarrier, alignment
    staged = 8 + 16 * 4 * (64 * 16 + 16)  # the mbarrier, (token, source) rows padded like fn's
    reductions = 16 * (20 + (16 + 8 + 1) * 25 + 16 + 8) * 4
    assert kernel.shared_bytes() == mma_shared_bytes(4096, 8, 16) == fn + staged + reductions <= MAX_SHARED_BYTES
    from mhc_glm5.grouped_mma import MmaGroupBoundaryKernel

    with pytest.raises(ValueError, match="tokens: expected one of"):
        MmaGroupBoundaryKernel(boundary("sm_90a", 4).config)  # 4 tokens: the CUDA-core kernel


@pytest.mark.parametrize("arch", ARCHS)
def test_mixes_kernel_polls_the_handoff_rows(arch: str) -> None:
    """Each token's 24 raw mixes: 6 volatile 16-byte loads in the spin loop, then 6 stores re-arm
    the row and 6 copy it to the raw-mixes record."""
    from mhc_glm5.mixes import MixesConfig, MixesKernel

    ptx = compiled(MixesKernel(MixesConfig(hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20)), arch)
    assert polls_volatile_in_loop(ptx)
    assert count(ptx, "ld.volatile.global.v4.u32") == 6
    assert count(ptx, "st.global.v4.u32") == 12
    assert count(ptx, "bar.warp.sync") >= 1, "the warp converges before the Sinkhorn"
    assert count(ptx, "rcp.approx") == 4 + (4 + 19 * 4 + 20 * 4), "4 post sigmoids, then the Sinkhorn's"


@pytest.mark.parametrize("hidden", (4096, 4608))
@pytest.mark.parametrize("kernel", ("one-token", "tensor-core"))
def test_staged_fn_reads_have_no_bank_conflicts(kernel: str, hidden: int) -> None:
    """Each quarter-warp's 16-byte reads of the staged fn slice touch 8 distinct bank groups.

    One-token kernel: lane ``4 g + j`` reads chunk ``4 r + j`` at fragment ``g``; tensor-core
    kernel: lane ``4 g + q`` reads chunk ``4 (8 tile + g) + q`` at the warp's fragment ``f``.
    """
    from mhc_glm5.config import FN_ROTATION_ROWS, FN_ROTATION_STREAMS, fn_chunk_words

    fragments = hidden // 8 // 8
    rotation = FN_ROTATION_STREAMS if kernel == "one-token" else FN_ROTATION_ROWS
    stride = fn_chunk_words(fragments, rotation)
    assert stride >= 4 * fragments and (stride - 4 * fragments) < 32
    for outer in range(24 if kernel == "one-token" else 3):  # fn row / n-tile
        for first in range(0, 32, 8):  # the quarter-warps
            for base in range(0, fragments - 1, 2 if kernel == "one-token" else 1):
                words = []
                for lane in range(first, first + 8):
                    g, j = lane // 4, lane % 4
                    if kernel == "one-token":
                        words.append((4 * outer + j) * stride + 4 * (base + g - first // 4))
                    else:
                        words.append((4 * (8 * outer + g) + j) * stride + 4 * base)
                assert len({word // 4 % 8 for word in words}) == 8, (kernel, hidden, outer, first, base)
