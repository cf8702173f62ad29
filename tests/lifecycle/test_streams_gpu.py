"""One op called on two streams at once (DSV tp 1, GLM tp 1, LamportAllReduce on loopback tp 2
with each rank's op on both streams): both calls released together by one event, and still
bitwise the same calls made one after another on one stream, because the op orders a call
behind its previous one. A second instance of a configuration compiles nothing, and two
instances on two streams at once give correct results."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from tests.lifecycle.common import CORE, DSV, GLM, assert_results_equal, core_ops, dsv_ops, glm_ops, sleep_cycles

pytestmark = pytest.mark.gpu

CAPACITY = 32
REPEATS = 10
GATE_MS = 30.0
FAMILIES = {"dsv41": DSV, "glm5": GLM, "core": CORE}
_OPS: dict[str, list] = {}


def build(family: str) -> list:
    if family == "dsv41":
        return dsv_ops("h200-tp1-h5120", CAPACITY)
    if family == "glm5":
        return glm_ops("h200-tp1-h4096", CAPACITY)
    return core_ops(2, CAPACITY)


def ops_for(family: str) -> list:
    if family not in _OPS:
        _OPS[family] = build(family)
    return _OPS[family]


def build_without_compiling(family: str) -> list:
    """A second instance of ``ops_for(family)``'s configuration, with ``cute.compile`` refused (the
    compiler imports the DSL only when it compiles: the patch is on the DSL's own function). On a
    host with the DSL's runtime alone there is no compiler to refuse: the DSL must stay unimported."""
    ops_for(family)
    try:
        import cutlass.cute
    except ImportError:
        second = build(family)
        imported = sorted(name for name in sys.modules if name.split(".")[0] == "cutlass")
        assert not imported, f"the DSL was imported: {imported[:3]}"
        return second

    def refuse(*args, **kwargs):
        raise AssertionError("cute.compile called while building a second instance of a compiled configuration")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cutlass.cute, "compile", refuse)
        return build(family)


def gate(streams, cycles: int) -> None:
    """Hold ``streams`` behind one event recorded after a sleep: what they get next starts together."""
    gate_stream = torch.cuda.Stream()
    gate_stream.wait_stream(torch.cuda.current_stream())  # the inputs were made there
    with torch.cuda.stream(gate_stream):
        torch.cuda._sleep(cycles)
    opened = torch.cuda.Event()
    opened.record(gate_stream)
    for stream in streams:
        stream.wait_event(opened)


@pytest.mark.parametrize("family", tuple(FAMILIES))
def test_one_op_on_two_streams_at_once(family: str) -> None:
    model, ops = FAMILIES[family], build(family)  # its own ops: overlapping calls may leave them broken
    rng = random.Random(family)
    generator = torch.Generator("cuda").manual_seed(len(family))
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    cycles = sleep_cycles(GATE_MS)
    for repeat in range(REPEATS):
        cases = [model.case(ops, rng.randint(1, CAPACITY), generator) for _ in streams]
        outs = [model.outputs(ops, case.m) for case in cases]
        gate(streams, cycles)
        for stream, case, out in zip(streams, cases, outs, strict=True):
            with torch.cuda.stream(stream):
                model.call(ops, case, out)  # GLM: joined under this stream
        torch.cuda.synchronize()
        for index, (case, out) in enumerate(zip(cases, outs, strict=True)):
            # The same call alone on the current stream, checked against the reference too.
            alone = model.call(ops, case, model.outputs(ops, case.m))
            model.check(ops, alone, case)
            assert_results_equal(model, out, alone, f"repeat {repeat}, call {index} (M = {case.m})")


@pytest.mark.parametrize("family", tuple(FAMILIES))
def test_second_instance_compiles_nothing(family: str) -> None:
    model, first = FAMILIES[family], ops_for(family)
    second = build_without_compiling(family)
    for a, b in zip(first, second, strict=True):
        assert a is not b and a.mailbox.buffer.data_ptr() != b.mailbox.buffer.data_ptr()
    case = model.case(second, 5, torch.Generator("cuda").manual_seed(5))
    model.check(second, model.call(second, case, model.outputs(second, 5)), case)


@pytest.mark.parametrize("family", tuple(FAMILIES))
def test_two_instances_on_two_streams_at_once(family: str) -> None:
    model = FAMILIES[family]
    instances = (ops_for(family), build_without_compiling(family))
    rng = random.Random(family + "two")
    generator = torch.Generator("cuda").manual_seed(7 + len(family))
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    cycles = sleep_cycles(GATE_MS)
    for _ in range(REPEATS // 2):
        cases = [model.case(ops, rng.randint(1, CAPACITY), generator) for ops in instances]
        outs = [model.outputs(ops, case.m) for ops, case in zip(instances, cases, strict=True)]
        gate(streams, cycles)
        results = []
        for stream, ops, case, out in zip(streams, instances, cases, outs, strict=True):
            with torch.cuda.stream(stream):
                results.append(model.call(ops, case, out))
        torch.cuda.synchronize()
        for ops, result, case in zip(instances, results, cases, strict=True):
            model.check(ops, result, case)  # GLM: each instance's raw mixes are its own call's
