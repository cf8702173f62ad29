"""``close()`` on the GPU: the mailbox's memory goes back to the allocator, later calls raise, and a
closed op's custom-op handle is refused (tp 1 and a loopback pair)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tests.support import assert_bitwise_equal, bf16_randn, build_ranks, run_ranks

pytestmark = pytest.mark.gpu


def test_close_frees_the_mailbox_and_refuses_calls() -> None:
    from mhc_core import LamportAllReduce, reference

    op = LamportAllReduce(hidden_size=4096, max_num_tokens=1024, device="cuda")
    x = bf16_randn(4, 4096)
    assert_bitwise_equal(op(x), reference.all_reduce([x]))
    mailbox, state = weakref.ref(op.mailbox.memory), weakref.ref(op.state)
    with op:
        pass  # the context manager closes
    gc.collect()
    assert mailbox() is None and state() is None, "close() left the mailbox or the stage state alive"
    with pytest.raises(RuntimeError, match="was closed"):
        op(x)
    op.close()  # idempotent


def test_close_on_loopback_ranks() -> None:
    from mhc_core import LamportAllReduce, reference

    ops = build_ranks(2, lambda group: LamportAllReduce(hidden_size=4096, max_num_tokens=8, device="cuda", group=group))
    x = [bf16_randn(3, 4096) for _ in ops]
    for result in run_ranks(ops, "call", [(t,) for t in x]):
        assert torch.equal(result, reference.all_reduce(x))
    for op in ops:
        op.close()
    with pytest.raises(RuntimeError, match="was closed"):
        run_ranks(ops, "call", [(t,) for t in x])
