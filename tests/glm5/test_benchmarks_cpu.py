"""GLM-5.3's benchmark suites (``mhc_glm5.bench``) without a GPU: the glm5-overlap suite's
registration, GEMM shape (the demo decoder's QKV projection), variants (traced on fake tensors), order
check and table; the persistent suite's registration; the thresholds suite's sizes."""

from __future__ import annotations

import torch


def test_persistent_glm_suite_is_registered() -> None:
    from benchmarks.run import DEFAULT_SUITES, RUNNERS, SUITES

    assert "glm5-persistent" in SUITES and RUNNERS["glm5-persistent"].__name__ == "glm5_persistent"
    assert "glm5-persistent" not in DEFAULT_SUITES


def test_thresholds_suite_runs_at_its_own_sizes(monkeypatch) -> None:
    from benchmarks import run
    from mhc_glm5.bench import suites

    seen = []
    monkeypatch.setattr(suites, "glm5_thresholds", lambda ctx, ms: seen.append(ms) or [])
    assert run.RUNNERS["glm5-thresholds"](None, [1]) == [] and seen == [list(suites.THRESHOLD_M)]


def test_overlap_attention_is_the_demo_decoders() -> None:
    """The package cannot import the repository's ``demo``: its copy of the attention shape must agree."""
    from demo.config import GLM5
    from mhc_glm5.bench.overlap import ATTENTION, HIDDEN

    attention = GLM5.attention
    expected = (attention.heads, attention.kv_heads, attention.head_dim)
    assert expected == ATTENTION and GLM5.hidden == HIDDEN


def test_overlap_suite_is_registered(monkeypatch) -> None:
    """``--suite glm5-overlap`` runs ``mhc_glm5.bench.overlap`` at the --m values up to 64 and prints its
    own table; a plain run leaves it out (it compiles a dozen functions)."""
    from benchmarks import run
    from mhc_glm5.bench import overlap

    seen = []
    monkeypatch.setattr(overlap, "glm5_overlap", lambda ctx, ms: seen.append(ms) or [])
    assert run.RUNNERS["glm5-overlap"](None, list(run.DEFAULT_M)) == []
    assert seen == [[1, 8, 64]]
    assert "glm5-overlap" in run.SUITES and "glm5-overlap" not in run.DEFAULT_SUITES
    assert run.TABLES["glm5-overlap"] is overlap.overlap_table


def test_overlap_gemm_is_the_demo_qkv_projection() -> None:
    from mhc_glm5.bench.overlap import gemm_bytes, projection_shape

    assert projection_shape(1) == (4096, (32 + 2 * 8) * 128)
    assert projection_shape(2) == (4096, 3072)  # column-parallel: each rank holds half the heads
    assert gemm_bytes(8, 1) == 2 * (4096 * 6144 + 8 * 4096 + 8 * 6144)


def test_overlap_variants_trace_in_the_order_they_name() -> None:
    """Each variant traces into one graph (fake CUDA tensors, no GPU) calling the boundary, the GEMM
    and the join in the order its label gives; the suite checks inductor's generated code on the GPU."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    import mhc_glm5.library  # noqa: F401  (registers the ops)
    from mhc_glm5.bench.overlap import VARIANTS

    m, hidden, mix = 3, 64, 24
    names = {"mhc.glm5_boundary": "boundary", "mhc.glm5_join": "join", str(F.linear): "gemm"}
    with FakeTensorMode():
        bf16, f32 = torch.bfloat16, torch.float32
        state = torch.empty(4, dtype=torch.int32, device="cuda")
        op = SimpleNamespace(state=state, handle=7)
        inputs = [
            torch.empty(shape, dtype=dtype, device="cuda")
            for shape, dtype in (
                ((96, hidden), bf16),  # the projection, [out, in]
                ((m, hidden), bf16), ((m, 4, hidden), bf16), ((m, 4, 1), f32),
                ((m, 4, 4), f32), ((mix, 4 * hidden), bf16), ((3,), f32), ((mix,), f32), ((hidden,), bf16),
            )
        ]  # fmt: skip
        for label, (function, expected) in VARIANTS.items():
            graphs = []

            def backend(gm, example_inputs, graphs=graphs):
                graphs.append(gm)
                return gm.forward

            torch._dynamo.reset()
            torch.compile(function, fullgraph=True, backend=backend)(op, *inputs)
            assert len(graphs) == 1, label
            calls = [names[str(n.target)] for n in graphs[0].graph.nodes if str(n.target) in names]
            assert tuple(calls) == expected, f"{label}: {calls}"


def test_overlap_call_order_reads_the_generated_call() -> None:
    """The order check reads the calls of inductor's ``call`` function, not its comments."""
    from mhc_glm5.bench.overlap import call_order

    code = """
def triton_poi_fused_0(in_ptr0, ...): pass  # mhc.glm5_join in a kernel name does not count
class Runner:
    def call(self, args):
        # Topologically Sorted Source Nodes: [glm5_join], Original ATen: [mhc.glm5_join]
        buf0 = torch.ops.mhc.glm5_boundary.default(arg1_1, 1, arg0_1)
        extern_kernels.mm(buf3, reinterpret_tensor(arg9_1, (4096, 6144), (1, 4096), 0), out=buf4)
        buf5 = torch.ops.mhc.glm5_join.default(arg1_1, 1, buf2)
"""
    assert call_order(code) == ("boundary", "gemm", "join")
    assert call_order(code.replace("extern_kernels.mm(buf3", "extern_kernels.bmm(buf3")) == ("boundary", "join")


def test_overlap_table_derives_the_hidden_time() -> None:
    from mhc_core.bench.records import Record
    from mhc_glm5.bench.overlap import overlap_table

    times = {"(a) boundary + join": 6.0, "(b) qkv gemm": 14.0, "(c) boundary, gemm, join": 17.5,
             "(d) boundary, join, gemm": 20.0}  # fmt: skip
    records = [Record("glm5-overlap", 1, 8, label, us, 15.0) for label, us in times.items()]
    assert "| 1 | 8 | 6.00 | 14.00 | 20.00 | 17.50 | 20.00 | 2.50 |" in overlap_table(records)
