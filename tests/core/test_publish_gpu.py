"""Publish addressing on the GPU: the multicast path's debug variant and two-phase misuse."""

from __future__ import annotations

import pytest
import torch

from tests.support import bf16_randn

pytestmark = pytest.mark.gpu


def test_multicast_addressing_through_local_debug_store() -> None:
    """The multicast kernel with its multimem store swapped for a local store writes each rank's
    fragment into slot [stage, rank, token] and nothing else (multicast itself never runs here)."""
    from mhc_core import LoopbackGroup
    from mhc_core.device.protocol import STORE_MULTICAST_LOCAL
    from mhc_core.device.publish import PublishConfig, PublishKernel
    from mhc_core.host.binaries.compiler import compile_kernel, device_arch
    from mhc_core.host.binaries.launch import BoundKernel
    from mhc_core.host.ranks.groups import MailboxMemory  # noqa: F401  (the layout the kernel addresses
    from mhc_core.host.ranks.mailbox import LamportMailbox
    from mhc_core.reference import sanitize

    tp, hidden, capacity, m = 4, 4608, 8, 5
    group = LoopbackGroup(tp, "cuda")
    kernel = PublishKernel(PublishConfig(hidden=hidden, tp=tp, store=STORE_MULTICAST_LOCAL))
    compiled = compile_kernel(kernel, device_arch())
    xs = [bf16_randn(m, hidden) for _ in range(tp)]
    for rank in range(tp):
        mailbox = LamportMailbox(
            group[rank], capacity=capacity, hidden=hidden, device=group.device, transport="unicast"
        )
        local = torch.tensor([mailbox.buffer.data_ptr()], dtype=torch.int64, device="cuda")
        mailbox.stage_state[0] = 2  # publish into generation 2
        bound = BoundKernel(
            compiled.function,
            kernel.signature(),
            dict(stage_state=mailbox.stage_state, destinations=local, rank=rank, capacity=capacity, token_check=1),
        )
        bound(x=xs[rank], m=m)
        torch.cuda.synchronize()
        slots = mailbox.buffer.view(torch.int16)
        expected = torch.full_like(slots, -32768)
        expected[2, rank, :m] = sanitize(xs[rank]).view(torch.int16)
        assert torch.equal(slots, expected), f"rank {rank}: wrong slots written"
        header = mailbox.header.view(torch.int32)
        expected_header = torch.full_like(header, -2147450880)  # BF16 -0 pairs: empty entries
        expected_header[2, rank] = 2 * m + 1  # this rank's M, encoded (``protocol.encode_count``)
        assert torch.equal(header, expected_header), f"rank {rank}: wrong header entries written"
        assert mailbox.stage_state.tolist() == [2, 0, 2, 0]  # NEXT, ERROR, ACTIVE, ERROR


def test_collect_without_publish_is_refused() -> None:
    from mhc_core import LamportAllReduce

    op = LamportAllReduce(hidden_size=4096, max_num_tokens=4, device="cuda")
    with pytest.raises(RuntimeError, match="no publish"):
        op.collect()
    op.publish(bf16_randn(2, 4096))
    with pytest.raises(RuntimeError, match="has not been collected"):
        op.publish(bf16_randn(2, 4096))
    with pytest.raises(RuntimeError, match="pending"):
        op(bf16_randn(2, 4096))
    op.collect()
