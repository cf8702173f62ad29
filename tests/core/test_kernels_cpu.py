"""Every mhc-core kernel compiles for every arch without a GPU; what the PTX must (not) contain."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.ptx_checks import count, has_local_memory, instructions, polls_volatile_in_loop

ARCHS = ("sm_90a", "sm_100a", "sm_103a")
ROOT = Path(__file__).resolve().parents[2]


def compiled(kernel, arch):
    from mhc_core.host.binaries.compiler import compile_kernel

    result = compile_kernel(kernel, arch, inspect=True)
    assert result.ptx, "no PTX kept"
    report = result.report
    assert report.registers is not None, "ptxas report missing"
    assert report.spill_stores == 0 and report.spill_loads == 0, report
    assert report.stack_bytes == 0, f"local memory in use: {report}"
    assert not has_local_memory(result.ptx)
    return result.ptx


def publish(store="unicast", trigger="after_stores", top_k=0, weights="float32", hidden=4608, tp=4):
    from mhc_core.device.publish import FinalizePublishKernel, PublishConfig, PublishKernel

    config = PublishConfig(hidden=hidden, tp=tp, store=store, trigger=trigger, top_k=top_k, weights=weights)
    return (FinalizePublishKernel if top_k else PublishKernel)(config)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("trigger", ("after_stores", "after_wait"))
def test_publish_unicast(arch: str, trigger: str) -> None:
    ptx = compiled(publish(trigger=trigger), arch)
    lines = instructions(ptx)
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
    first_load = next(i for i, line in enumerate(lines) if "ld.global.v4.u32" in line)
    stores = [i for i, line in enumerate(lines) if "st.global.v4.u32" in line]
    assert wait < first_load, "x is read before the PDL wait"
    assert len(stores) == 8, "one 16-byte store per rank (tp = 4), and each rank's header entry (M)"
    assert count(ptx, "ld.volatile.global.v2.u32") == 1, "the stage and the error word beside it, in one load"
    assert count(ptx, "ld.volatile.global.u32") == 0
    if trigger == "after_wait":
        assert launch < first_load
    else:
        assert launch > max(stores)
    assert count(ptx, "multimem") == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_publish_multicast(arch: str) -> None:
    ptx = compiled(publish(store="multicast"), arch)
    assert count(ptx, "multimem.st.relaxed.sys.global.v4.bf16x2") == 2, "the fragment and the header entry"
    assert count(ptx, "st.global.v4") == 0, "the multicast publish has no unicast peer stores"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("weights", ("float32", "bfloat16"))
@pytest.mark.parametrize("store", ("unicast", "multicast"))
def test_finalize_publish(arch: str, weights: str, store: str) -> None:
    ptx = compiled(publish(store=store, top_k=8, weights=weights, hidden=5120, tp=8), arch)
    assert count(ptx, "griddepcontrol.wait") == 1
    assert count(ptx, "ld.global.v4.u32") == 9, "the shared row and all top_k rows, 16 bytes each"
    if store == "multicast":
        assert count(ptx, "multimem.st") == 2 and count(ptx, "st.global.v4") == 0
    else:
        assert count(ptx, "multimem") == 0 and count(ptx, "st.global.v4.u32") == 16


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp,lanes", [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2), (4, 4), (8, 8)])
def test_collective(arch: str, tp: int, lanes: int) -> None:
    from mhc_core.device.one_shot.collective import CollectiveConfig, CollectiveKernel

    ptx = compiled(CollectiveKernel(CollectiveConfig(hidden=7168, tp=tp, lanes=lanes)), arch)
    assert polls_volatile_in_loop(ptx), "the poll's volatile loads must sit inside the spin loop"
    assert count(ptx, "griddepcontrol.wait") == 1 and count(ptx, "griddepcontrol.launch_dependents") == 1
    assert count(ptx, "%globaltimer") >= 1, "the spin bound reads the global timer"
    assert count(ptx, "st.relaxed.sys.global.u32") >= 1, "timeouts are reported to host-mapped memory"


@pytest.mark.parametrize("arch", ARCHS)
def test_sinkhorn(arch: str) -> None:
    from mhc_core.device.sinkhorn import SinkhornConfig, SinkhornKernel

    ptx = compiled(SinkhornKernel(SinkhornConfig(repeat=20)), arch)
    assert count(ptx, "rcp.approx") == 4 + 19 * 4 + 20 * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_dot_bf16x8_variants(arch: str) -> None:
    """sm_100+ uses fma.rn.f32.bf16; sm_90a the exact unpack + fma.rn.f32 (ptxas rejects the former)."""
    from mhc_core.host.binaries.compiler import arch_has_mixed_bf16_fma
    from tests.core.dot_kernel import DotKernel

    ptx = compiled(DotKernel(arch_has_mixed_bf16_fma(arch)), arch)
    if arch == "sm_90a":
        assert count(ptx, "fma.rn.f32.bf16") == 0 and count(ptx, "fma.rn.f32") >= 8
    else:
        assert count(ptx, "fma.rn.f32.bf16") == 8


PTX_PATTERN = re.compile(
    r"\b(ld|st)\.(global|shared|volatile|relaxed)|multimem\.|griddepcontrol\.|fma\.rn|cvt\.rn|mov\.b32|\.reg\s"
)


def string_literals(tree: ast.AST) -> list[ast.Constant]:
    """Every string constant of a module except docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_no_ptx_text_outside_the_primitives_module() -> None:
    offenders = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        if path.name == "ptx.py" and path.parent.name == "device" and path.parent.parent.name == "mhc_core":
            continue
        for node in string_literals(ast.parse(path.read_text())):
            if PTX_PATTERN.search(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not offenders, "PTX text outside mhc_core/device/ptx.py:\n" + "\n".join(offenders)


def test_the_ptx_check_sees_asm_strings() -> None:
    source = 'X = "ld.volatile.global.v4.u32 {$0}, [$1];"\n'
    assert any(PTX_PATTERN.search(node.value) for node in string_literals(ast.parse(source)))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_division_check_kernel(arch: str) -> None:
    """The GPU test's exhaustive division check compiles, both ways of dividing in it."""
    from tests.core.fp8_division_kernel import DivisionConfig, DivisionKernel

    ptx = compiled(DivisionKernel(DivisionConfig()), arch)
    assert count(ptx, "div.rn.f32") >= 2 and count(ptx, "rcp.approx.ftz.f32") >= 1  # the scale and the check (unrolled)
