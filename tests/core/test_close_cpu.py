"""``close()`` on the host side (no GPU here): idempotent, every later call refused by name before any
launch, the handle forgotten by the custom ops, the op's device state dropped, usable as a context
manager. The device side (memory given back) runs on the GPU: tests/core/test_close_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


class Group:
    kind = "none"
    barriers = 0

    def barrier(self) -> None:
        Group.barriers += 1

    def missing_peers(self, op) -> list[int]:
        return []


def built_op(monkeypatch: pytest.MonkeyPatch):
    """A LamportAllReduce as construction leaves it, with the device parts stood in for."""
    from mhc_core import LamportAllReduce
    from mhc_core.host import library, op

    monkeypatch.setattr(op.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(op.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(op, "CallOrder", lambda device: object())
    monkeypatch.setattr(library.torch._dynamo, "mark_static_address", lambda tensor: None)
    instance = LamportAllReduce.__new__(LamportAllReduce)
    instance.device, instance.group, instance._closed = torch.device("cuda", 0), Group(), False
    instance._init_call_state()  # the lock and the launch marker every call path uses
    instance._order = SimpleNamespace(follow=lambda: None)  # nothing to order on the CPU
    instance.mailbox = type("Mailbox", (), {"stage_state": torch.zeros(4, dtype=torch.int32)})()
    instance._programs = object()
    instance.handle = library.register(instance)
    return instance


def test_close_is_idempotent_and_refuses_later_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.host import library

    op = built_op(monkeypatch)
    handle = op.handle
    Group.barriers = 0
    op.close()
    op.close()
    assert Group.barriers == 1, "the second close() does nothing"
    assert op.mailbox is None and op._programs is None
    with pytest.raises(RuntimeError, match="LamportAllReduce was closed"):
        op(torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="was closed"):
        op.publish(torch.zeros(1, 8))
    with pytest.raises(ValueError, match=f"no live mhc op has handle {handle}"):
        library.lookup(handle)


def test_context_manager_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    op = built_op(monkeypatch)
    with op as entered:
        assert entered is op
    assert op._closed and op.mailbox is None


def test_close_refuses_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhc_core.host import op as module

    op = built_op(monkeypatch)
    monkeypatch.setattr(module.torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="not inside a CUDA-graph capture"):
        op.close()
    assert not op._closed
