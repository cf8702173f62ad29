"""The GLM op's FP8 layer-input option (issue #33) without a GPU.

* The constructor: every format (and the BF16 copy beside it) reaches the build; a bad name, type,
  hidden size or a group that would straddle a cluster's CTAs raises naming the argument before any
  compile; ``from_config`` / ``from_preset`` take a preset's option, and an explicit one replaces it.
* Presets and codegen validate and render the option; a preset's boundary kernels are its format's,
  its publishes and mixes kernel the same as BF16's.
* The call, through the real native programs on CPU tensors with recorder kernels (as
  ``tests.core.test_launch_wiring_cpu``): ``__call__`` (plain and MoE input) and ``collect`` return
  ``(residual_out, post_out, comb_out, q, scales[, layer_input])`` with ``mhc_core.fp8``'s dtypes,
  shapes, strides and allocations; the boundary gets those addresses, the side-stream mixes kernel
  post_out and comb_out as before (it never reads the layer input); ``out=`` in the same order is
  written in place; a wrong ``out=`` is refused naming the output before any launch.
* The custom ops: fake implementations give every format's outputs (a symbolic M too) under
  ``torch.compile(fullgraph=True)``, no graph break, the join after them; the wrappers pick the ops
  by the op's format; the real op refuses a format that is not its own.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.core.test_launch_wiring_cpu import CPU, Kernels, Order

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: 5 groups of 128 (a partial last word of packed scales), 20 of 32; 80 fragments, 5 CTAs of 16.
HIDDEN, HC, MIX, TOP_K, CAPACITY, CLUSTER = 640, 4, 24, 2, 160, 5
#: M = 3: padding rows of both UE8M0 layouts; 130: a second 128-row tile of the swizzled one.
TOKENS = (3, 130)
#: The recorder op's boundary variants: 2 tokens per cluster from M = 4, the persistent one from 128.
CLUSTER_TOKENS, PERSISTENT_MIN_TOKENS = ((4, 2),), 128
F8 = torch.float8_e4m3fn


# ------------------------------------------------------------------ the constructor
class BuildStarted(Exception):
    """Raised where construction leaves validation (the arch is read): every check has passed."""


@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    import mhc_core.host.op

    def started(device):
        raise BuildStarted(str(device))

    monkeypatch.setattr(mhc_core.host.op, "device_arch", started)


#: The H200 presets' constants (public glm5_next config).
GOOD = dict(
    hidden_size=4096, max_num_tokens=8, rms_eps=1e-6, hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20, norm_eps=1e-5,
    device="cuda:0", top_k=8,
)  # fmt: skip


@pytest.mark.parametrize("fmt, both", [("bf16", False), *((fmt, both) for fmt in FORMATS for both in (False, True))])
def test_every_format_reaches_the_build(no_build, fmt: str, both: bool) -> None:
    from mhc_glm5 import AllReduceMhcBoundary

    with pytest.raises(BuildStarted):
        AllReduceMhcBoundary(**GOOD, cluster_tokens=[[16, 8]], layer_input_format=fmt, layer_input_bf16=both)


BAD_OPTIONS = [
    (dict(layer_input_format="fp8"), ValueError, "layer_input_format: expected one of bf16, fp32-g128"),
    (dict(layer_input_format="FP32-G128"), ValueError, "layer_input_format: expected one of"),
    (dict(layer_input_format=None), TypeError, "layer_input_format: expected a str"),
    (dict(layer_input_format="mx-g32", layer_input_bf16=1), TypeError, "layer_input_bf16: expected a bool, got int"),
    (dict(layer_input_bf16=True), ValueError, "layer_input_bf16: .*expected False"),
    # 4160 = 32.5 groups of 128; 4104 = 128.25 groups of 32.
    (dict(hidden_size=4160, layer_input_format="fp32-g128"), ValueError, "layer_input_format: .*hidden_size = 4160"),
    (dict(hidden_size=4104, layer_input_format="mx-g32"), ValueError, "layer_input_format: .*multiple of 32"),
    # 4608 / 8 / 8 = 72 fragments per CTA: 4.5 groups of 128 columns (whole groups of 32).
    (dict(hidden_size=4608, layer_input_format="ue8m0-g128-packed"), ValueError, "cluster_size: .*may not straddle"),
]


@pytest.mark.parametrize("change, error, message", BAD_OPTIONS)
def test_bad_options_name_their_argument(no_build, change: dict, error: type, message: str) -> None:
    from mhc_glm5 import AllReduceMhcBoundary

    with pytest.raises(error, match=f"^{message}"):
        AllReduceMhcBoundary(**{**GOOD, **change})


def test_hidden_4608_takes_the_32_column_groups(no_build) -> None:
    from mhc_glm5 import AllReduceMhcBoundary

    with pytest.raises(BuildStarted):
        AllReduceMhcBoundary(**{**GOOD, "hidden_size": 4608}, layer_input_format="mx-g32")


def test_from_config_takes_the_presets_option_and_an_explicit_one_replaces_it(monkeypatch) -> None:
    from mhc_glm5 import AllReduceMhcBoundary, presets

    seen = []

    def fake_build(self, preset, **options):  # the one path every op takes, from its preset
        seen.append({key: getattr(preset, key) for key in ("layer_input_format", "layer_input_bf16")})

    monkeypatch.setattr(AllReduceMhcBoundary, "_init_from_preset", lambda self, preset, **options: None)
    monkeypatch.setattr(AllReduceMhcBoundary, "_build", lambda self, preset, *args, **options: fake_build(self, preset))
    preset = dataclasses.replace(
        presets.get("h200-tp1-h4096").PRESET, layer_input_format="ue8m0-g128-packed", layer_input_bf16=True
    )
    AllReduceMhcBoundary.from_config(preset, max_num_tokens=8, device="cuda")
    AllReduceMhcBoundary.from_config(preset, max_num_tokens=8, device="cuda", layer_input_format="mx-g32")
    AllReduceMhcBoundary.from_config(preset, max_num_tokens=8, device="cuda", layer_input_bf16=False)
    AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=8, device="cuda", layer_input_format="fp32-g128")
    AllReduceMhcBoundary.from_preset("h200-tp1-h4096", max_num_tokens=8, device="cuda")
    assert seen == [
        {"layer_input_format": "ue8m0-g128-packed", "layer_input_bf16": True},
        {"layer_input_format": "mx-g32", "layer_input_bf16": False},  # the format given: not the preset's copy
        {"layer_input_format": "ue8m0-g128-packed", "layer_input_bf16": False},
        {"layer_input_format": "fp32-g128", "layer_input_bf16": False},
        {"layer_input_format": "bf16", "layer_input_bf16": False},
    ]


# ------------------------------------------------------------------ presets
@pytest.mark.parametrize("both", (False, True))
def test_a_presets_kernels_are_its_formats_boundaries(both: bool) -> None:
    from mhc_glm5 import presets
    from mhc_glm5.boundary import BoundaryConfig

    base = presets.get("h200-tp1-h4096").PRESET
    preset = dataclasses.replace(base, layer_input_format="mx-g32", layer_input_bf16=both)
    specs, plain = preset.kernel_specs("sm_90a"), base.kernel_specs("sm_90a")
    assert set(specs) == set(plain)
    for name, (path, fields) in specs.items():
        if name.startswith("boundary"):
            config = BoundaryConfig(**fields)
            assert (config.layer_input_format, config.layer_input_bf16) == ("mx-g32", both)
            assert (
                path == plain[name][0]
                and {**fields, "layer_input_format": "bf16", "layer_input_bf16": False} == (plain[name][1])
            )
        else:
            assert (path, fields) == plain[name], "the publishes and the mixes kernel do not depend on the format"


def test_codegen_validates_and_renders_the_option(tmp_path) -> None:
    from codegen.load import CodegenError, load_presets
    from codegen.render import environment, render_preset

    table = """
[glm5.h200-tp1-h4096-fp8]
hidden = 4096
hc = 4
tp = 1
top_k = 8
cluster_size = 8
cluster_tokens = [[16, 8], [128, 16]]
persistent_min_tokens = 256
rms_eps = 1e-6
hc_eps = 1e-6
post_mult = 2.0
sinkhorn_repeat = 20
norm_eps = 1e-5
archs = ["sm_90a"]
layer_input_format = "{fmt}"
layer_input_bf16 = {both}
"""
    path = tmp_path / "presets.toml"
    path.write_text(table.format(fmt="ue8m0-g128-packed", both="true"))
    (preset,) = load_presets(path)
    assert (preset.value.layer_input_format, preset.value.layer_input_bf16) == ("ue8m0-g128-packed", True)
    text = render_preset(environment(), preset, "presets.toml")
    assert 'layer_input_format="ue8m0-g128-packed",' in text and "layer_input_bf16=True," in text
    assert text.count('"layer_input_format": "ue8m0-g128-packed"') == 4, "every boundary kernel"
    for fmt, both, key in (("fp8", "false", "layer_input_format"), ("bf16", "true", "layer_input_bf16")):
        path.write_text(table.format(fmt=fmt, both=both))
        with pytest.raises(CodegenError, match=rf"\[glm5.h200-tp1-h4096-fp8\] key '{key}': "):
            load_presets(path)


# ------------------------------------------------------------------ the call (recorder kernels)
def fp8_op(tp: int, fmt: str, both: bool):
    """An ``AllReduceMhcBoundary`` as construction leaves it, on the CPU, with recorder kernels (the
    boundary kernels' real signatures: FP8 ones append ``layer_input_q`` and ``layer_input_scales``)."""
    from types import SimpleNamespace

    from mhc_core.device.publish import FinalizePublishKernel, PublishConfig, PublishKernel
    from mhc_core.host.layer_input import LayerInput
    from mhc_glm5 import AllReduceMhcBoundary
    from mhc_glm5.boundary import BoundaryConfig, BoundaryKernel
    from mhc_glm5.config import PERSISTENT, BoundaryTarget, boundary_routing
    from mhc_glm5.mixes import MixesConfig, MixesKernel

    kernels = Kernels()
    op = object.__new__(AllReduceMhcBoundary)
    publish = dict(hidden=HIDDEN, tp=tp, threads=128, trigger="after_wait", store="unicast")
    config = BoundaryConfig(
        hidden=HIDDEN, tp=tp, cluster_size=CLUSTER, rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-5, mixed_fma=False,
        layer_input_format=fmt, layer_input_bf16=both,
    )  # fmt: skip
    routing = boundary_routing(CLUSTER_TOKENS, PERSISTENT_MIN_TOKENS)
    boundaries = {
        BoundaryTarget(1): config,
        BoundaryTarget(2): dataclasses.replace(config, tokens=2),
        PERSISTENT: dataclasses.replace(config, tokens=8, persistent=True),
    }
    assert set(boundaries) == set(routing.targets)
    finalize = {
        dtype: FinalizePublishKernel(PublishConfig(**publish, top_k=TOP_K, weights=name))
        for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16"))
    }
    mixes = MixesKernel(MixesConfig(hc_eps=1e-6, post_mult=2.0, sinkhorn_repeat=20))
    side = SimpleNamespace(handle=4321, fork_handle=0, launched_with=[], idle=True)
    side.launched = lambda capture, tensors, stream: side.launched_with.append(tuple(tensors))
    side.launching = lambda stream, capture, tensors: (0, 0)
    op.__dict__.update(
        hidden_size=HIDDEN, device=CPU, tp=tp, rank=0, capacity=CAPACITY, top_k=TOP_K, check_routes=False,
        _closed=False, _peers_ready=True, _pending_m=None, _order=Order(),
        group=SimpleNamespace(kind="none", missing_peers=lambda op: []),
        spin=SimpleNamespace(
            limit_ns=5, handoff_limit_ns=7, address=1234, checks_token_counts=False, check=lambda: None
        ),
        mailbox=SimpleNamespace(
            buffer=torch.zeros(64, dtype=torch.bfloat16), stage_state=torch.zeros(4, dtype=torch.int32),
            destinations=torch.zeros(tp, dtype=torch.int64),
        ),
        _publish_kernel=kernels.compiled("publish", PublishKernel(PublishConfig(**publish))),
        _finalize_kernels={dtype: kernels.compiled("finalize", kernel) for dtype, kernel in finalize.items()},
        cluster_tokens=CLUSTER_TOKENS, persistent_min_tokens=PERSISTENT_MIN_TOKENS, clusters=3,
        layer_input=LayerInput.checked(fmt, both, HIDDEN),
        routing=routing,
        _boundary_kernels={t: kernels.compiled(t.kernel_name, BoundaryKernel(c)) for t, c in boundaries.items()},
        _mixes_kernel=kernels.compiled("mixes", mixes),
        _mixes_handoff=torch.zeros(CAPACITY, MIX), _raw_mixes=torch.zeros(CAPACITY, MIX),
        _arrivals=torch.zeros(1, dtype=torch.int32), _side_work=side,
    )  # fmt: skip
    op._init_call_state()
    op._programs = op._build_programs()
    return op, kernels, side


def collect_args(m: int) -> tuple:
    return (
        torch.randn(m, HC, HIDDEN).to(torch.bfloat16), torch.rand(m, HC, 1), torch.rand(m, HC, HC),
        torch.randn(MIX, HC * HIDDEN).to(torch.bfloat16), torch.rand(3), torch.rand(MIX),
        torch.ones(HIDDEN, dtype=torch.bfloat16),
    )  # fmt: skip


def moe(m: int):
    from mhc_core import MoEOutput

    rows = m * TOP_K
    return MoEOutput(
        torch.randn(rows, HIDDEN).to(torch.bfloat16), torch.rand(m, TOP_K),
        torch.arange(rows, dtype=torch.int32).view(m, TOP_K), torch.randn(m, HIDDEN).to(torch.bfloat16),
    )  # fmt: skip


def expected_outputs(fmt: str, both: bool, m: int) -> list[tuple]:
    """(dtype, shape, strides, storage elements) of each output, from ``mhc_core.fp8``."""
    from mhc_core import fp8

    layout = fp8.get_format(fmt)
    outputs = [
        (torch.bfloat16, (m, HC, HIDDEN), (HC * HIDDEN, HIDDEN, 1), m * HC * HIDDEN),
        (torch.float32, (m, HC, 1), (HC, 1, 1), m * HC),
        (torch.float32, (m, HC, HC), (HC * HC, HC, 1), m * HC * HC),
        (F8, (m, HIDDEN), (HIDDEN, 1), m * HIDDEN),
        (
            layout.scale_dtype,
            layout.scale_shape(m, HIDDEN),
            layout.scale_strides(m, HIDDEN),
            layout.scale_storage_numel(m, HIDDEN),
        ),
    ]
    if both:
        outputs.append((torch.bfloat16, (m, HIDDEN), (HIDDEN, 1), m * HIDDEN))
    return outputs


def check_returned(returned: tuple, kernels: Kernels, side, fmt: str, both: bool, m: int) -> None:
    specs = expected_outputs(fmt, both, m)
    assert isinstance(returned, tuple) and len(returned) == len(specs)
    for index, (tensor, (dtype, shape, strides, storage)) in enumerate(zip(returned, specs, strict=True)):
        assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (dtype, shape, strides), index
        assert tensor.untyped_storage().nbytes() == storage * tensor.element_size(), f"output {index}: allocation"
    (boundary_name, boundary), (mixes_name, mixes) = kernels.calls[-2:]
    assert mixes_name == "mixes" and boundary_name.startswith("boundary")
    assert boundary["residual_out"] == returned[0].data_ptr()
    assert boundary["layer_input_q"] == returned[3].data_ptr()
    assert boundary["layer_input_scales"] == returned[4].data_ptr()
    # FP8 alone: the kernel writes no BF16 layer input (any aligned address: q's).
    assert boundary["layer_input"] == returned[5 if both else 3].data_ptr()
    assert boundary["m"] == mixes["m"] == m
    # The side stream's kernel: the hand-off rows, post_out and comb_out, as with BF16.
    assert (mixes["post_out"], mixes["comb_out"]) == (returned[1].data_ptr(), returned[2].data_ptr())
    assert side.launched_with[-1][:2] == (returned[1], returned[2])


def boundary_for(m: int) -> str:
    if m >= PERSISTENT_MIN_TOKENS:
        return "boundary_persistent"
    return "boundary_x2" if m >= CLUSTER_TOKENS[0][0] else "boundary"


@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", (1, 2))
def test_every_call_form_returns_the_formats_outputs(tp: int, fmt: str, both: bool) -> None:
    op, kernels, side = fp8_op(tp, fmt, both)
    for m in TOKENS:
        x = torch.randn(m, HIDDEN).to(torch.bfloat16)
        args = collect_args(m)
        check_returned(op(x, *args), kernels, side, fmt, both, m)
        assert kernels.names()[-2] == boundary_for(m)
        check_returned(op(moe(m), *args), kernels, side, fmt, both, m)
        assert kernels.names()[-3:] == ["finalize", boundary_for(m), "mixes"]
        op.publish(x)
        check_returned(op.collect(*args), kernels, side, fmt, both, m)


@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_is_written_in_place(fmt: str, both: bool) -> None:
    from mhc_core import fp8

    op, kernels, side = fp8_op(1, fmt, both)
    m = TOKENS[0]
    x = torch.randn(m, HIDDEN).to(torch.bfloat16)
    args = collect_args(m)
    out = [
        torch.empty(m, HC, HIDDEN, dtype=torch.bfloat16), torch.empty(m, HC, 1), torch.empty(m, HC, HC),
        torch.empty(m, HIDDEN, dtype=F8), fp8.get_format(fmt).empty_scales(m, HIDDEN),
    ]  # fmt: skip
    if both:
        out.append(x)  # the BF16 copy may be x itself, as the BF16 layer input may
    returned = op(x, *args, out=tuple(out))
    assert all(a is b for a, b in zip(returned, out, strict=True))
    check_returned(returned, kernels, side, fmt, both, m)
    op.publish(x)
    assert all(a is b for a, b in zip(op.collect(*args, out=out), out, strict=True)), "a list is taken too"


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_out_is_refused_before_any_launch(fmt: str) -> None:
    from mhc_core import fp8

    op, kernels, _ = fp8_op(2, fmt, False)
    m = TOKENS[0]
    layout = fp8.get_format(fmt)

    def good() -> list[torch.Tensor]:
        return [
            torch.empty(m, HC, HIDDEN, dtype=torch.bfloat16), torch.empty(m, HC, 1), torch.empty(m, HC, HC),
            torch.empty(m, HIDDEN, dtype=F8), layout.empty_scales(m, HIDDEN),
        ]  # fmt: skip

    def replaced(index: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = good()
        out[index] = tensor
        return out

    scales = r"out\[4\] \(layer_input_scales\)"
    cases = [
        (
            good()[:4],
            TypeError,
            r"out: expected a \(residual_out, post_out, comb_out, layer_input_q, layer_input_scales\) tuple of 5",
        ),
        (replaced(3, torch.empty(m, HIDDEN, dtype=torch.uint8)), TypeError, r"out\[3\] \(layer_input_q\): .*uint8"),
        (replaced(3, torch.empty(m + 1, HIDDEN, dtype=F8)), ValueError, r"out\[3\] \(layer_input_q\): expected shape"),
        (
            replaced(4, torch.empty(layout.scale_shape(m, HIDDEN), dtype=torch.float16)),
            TypeError,
            f"{scales}: .*float16",
        ),
        (replaced(4, layout.empty_scales(m + 128, HIDDEN)), ValueError, f"{scales}: expected shape"),
    ]
    if fmt == "ue8m0-g128-packed":
        shape, strides = layout.scale_shape(m, HIDDEN), layout.scale_strides(m, HIDDEN)
        words = layout.scale_storage_numel(m, HIDDEN)
        # A view whose own bounds hold: the kernel's padding rows (M .. align(M, 4)) would not fit.
        short = torch.empty(words - 1, dtype=torch.int32).as_strided(shape, strides)
        cases.append((replaced(4, short), ValueError, f"{scales}: expected a storage of at least {words}"))
    for out, error, message in cases:
        with pytest.raises(error, match=message):
            op(torch.randn(m, HIDDEN).to(torch.bfloat16), *collect_args(m), out=out)
        assert kernels.calls == [], f"{message}: a kernel was launched"
    op(torch.randn(m, HIDDEN).to(torch.bfloat16), *collect_args(m))  # still usable
    assert kernels.names() == ["publish", "boundary", "mixes"]


def test_bf16_ops_keep_their_outputs() -> None:
    """The default option's programs are the BF16 op's: four outputs, contiguous, no storage rule."""
    op, kernels, _ = fp8_op(1, "bf16", False)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    *_, layer_input = op(x, *collect_args(3))
    assert layer_input.dtype == torch.bfloat16 and layer_input.shape == (3, HIDDEN)
    assert "layer_input_q" not in kernels.calls[-2][1]
    assert not op._programs.call.sized_outputs and [r.name for r in op._programs.call.outputs] == [
        "out[0] (residual_out)",
        "out[1] (post_out)",
        "out[2] (comb_out)",
        "out[3] (layer_input)",
    ]


# ------------------------------------------------------------------ the custom ops
def traced(function, *args, dynamic: bool = False):
    """``torch.compile(fullgraph=True)`` through a backend that keeps Dynamo's graph (one: no break)."""
    import mhc_glm5.library  # noqa: F401  (registers the ops)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    outputs = torch.compile(function, fullgraph=True, backend=backend, dynamic=dynamic)(*args)
    assert len(graphs) == 1, f"expected one graph (no break), got {len(graphs)}"
    calls = [
        str(node.target).removeprefix("mhc.").split(".")[0]
        for node in graphs[0].graph.nodes
        if node.op == "call_function" and str(node.target).startswith("mhc.")
    ]
    return outputs, calls


def fake_inputs(mode, m: int) -> list:
    shapes = (
        ((4,), torch.int32), ((m, HIDDEN), torch.bfloat16), ((m, HC, HIDDEN), torch.bfloat16),
        ((m, HC, 1), torch.float32), ((m, HC, HC), torch.float32), ((MIX, HC * HIDDEN), torch.bfloat16),
        ((3,), torch.float32), ((MIX,), torch.float32), ((HIDDEN,), torch.bfloat16),
        ((2 * m, HIDDEN), torch.bfloat16), ((m, TOP_K), torch.float32), ((m, TOP_K), torch.int32),
    )  # fmt: skip
    with mode:
        return [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes]


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_outputs_are_the_formats(fmt: str, both: bool, dynamic: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def layer(state, x, residual, post, comb, fn, scale, base, weight, gemm2, weights, index):
        first = torch.ops.mhc.glm5_boundary_fp8(state, 3, x, residual, post, comb, fn, scale, base, weight, fmt, both)
        post_out, comb_out = torch.ops.mhc.glm5_join(state, 3, first[0])
        second = torch.ops.mhc.glm5_boundary_moe_fp8(
            state, 3, gemm2, weights, index, x, first[0], post_out, comb_out, fn, scale, base, weight, fmt, both
        )
        torch.ops.mhc.glm5_join(state, 3, second[0])
        torch.ops.mhc.publish(state, 3, x)
        third = torch.ops.mhc.glm5_collect_fp8(state, 3, second[0], post, comb, fn, scale, base, weight, fmt, both)
        return first, second, third, post_out, comb_out

    for m in TOKENS:
        mode = FakeTensorMode()
        inputs = fake_inputs(mode, m)
        with mode:
            (*results, post_out, comb_out), calls = traced(layer, *inputs, dynamic=dynamic)
        assert calls == [
            "glm5_boundary_fp8", "glm5_join", "glm5_boundary_moe_fp8", "glm5_join", "publish", "glm5_collect_fp8"
        ]  # fmt: skip
        assert (tuple(post_out.shape), tuple(comb_out.shape)) == ((m, HC, 1), (m, HC, HC))
        specs = expected_outputs(fmt, both, m)
        specs = [specs[0], *specs[3:]]  # post_out and comb_out come from the join
        if not both:  # the custom ops return four outputs, the last empty (LayerInput.op_outputs)
            specs = [*specs, (torch.bfloat16, (0,), (1,), None)]
        for outputs in results:
            assert len(outputs) == len(specs)
            for tensor, (dtype, shape, strides, _) in zip(outputs, specs, strict=True):
                assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (dtype, shape, strides)
                assert tensor.device.type == "cuda"


def test_the_wrappers_pick_the_ops_by_the_ops_format() -> None:
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhc_core.host.layer_input import LayerInput
    from mhc_glm5 import library

    mode = FakeTensorMode()
    state, x, residual, post, comb, fn, scale, base, weight, *_ = fake_inputs(mode, 5)
    for fmt, both, count in (("bf16", False, 2), ("mx-g32", False, 3), ("fp32-g128", True, 4)):
        op = SimpleNamespace(state=state, handle=9, layer_input=LayerInput(fmt, both))

        def layer(state, x, residual, post, comb, fn, scale, base, weight, op=op):
            outputs = library.boundary(op, x, residual, post, comb, fn, scale, base, weight)
            post_out, comb_out = library.join(op, outputs[0])
            torch.ops.mhc.publish(state, 9, x)
            return outputs, library.collect(op, outputs[0], post_out, comb_out, fn, scale, base, weight)

        with mode:
            (called, collected), calls = traced(layer, state, x, residual, post, comb, fn, scale, base, weight)
        suffix = "_fp8" if fmt != "bf16" else ""
        assert calls == [f"glm5_boundary{suffix}", "glm5_join", "publish", f"glm5_collect{suffix}"]
        assert isinstance(called, tuple) and len(called) == len(collected) == count


def test_the_real_op_refuses_another_format() -> None:
    """The fake derives the outputs from the arguments: the real op checks they are its own; the
    side outputs wait for the join either way."""
    from mhc_core.host import library as core_library
    from mhc_glm5 import library

    op, kernels, _ = fp8_op(1, "mx-g32", False)
    handle = core_library.register(op)
    try:
        args = (torch.randn(3, HIDDEN).to(torch.bfloat16), *collect_args(3))
        with pytest.raises(ValueError, match=r"layer_input_format: the op behind handle \d+ writes 'mx-g32'"):
            library._run_fp8(handle, op.state, "fp32-g128", False, lambda op: op(*args))
        assert kernels.calls == []
        outputs = library._run_fp8(handle, op.state, "mx-g32", False, lambda op: op(*args))
        assert isinstance(outputs, tuple) and len(outputs) == 4 and outputs[1].dtype == F8
        assert outputs[3].numel() == 0  # the BF16 layer input not kept: an empty fourth output
        post_out, comb_out = library._UNJOINED.pop(handle)
        assert (tuple(post_out.shape), tuple(comb_out.shape)) == ((3, HC, 1), (3, HC, HC))
    finally:
        core_library.unregister(handle)
