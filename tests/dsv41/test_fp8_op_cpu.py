"""The DSV op's FP8 layer-input option (issue #33) without a GPU.

* The constructor: every format (and the BF16 copy beside it) reaches the build; a bad name, type
  or hidden size raises naming the argument before any compile; ``from_config`` takes a preset's
  option, and an explicit one replaces it.
* Presets: ``DSV41Preset`` and codegen validate the option (an error naming the table and key); a
  preset's kernels are its format's collectives.
* The call, through the real native programs on CPU tensors with recorder kernels (as
  ``tests.core.test_launch_wiring_cpu``): ``__call__``, ``finalize`` and ``collect`` return
  ``(residual_out, q, scales[, layer_input])`` with ``mhc_core.fp8``'s dtypes, shapes, strides and
  allocations, and hand the kernel those addresses; ``out=`` in the same order is written in place;
  a wrong ``out=`` (arity, dtype, shape, strides, a storage too small for the padding rows, an
  overlap) is refused naming the output before any launch.
* The custom ops: their fake implementations give every format's outputs (dtypes, shapes, strides,
  a symbolic M too) under ``torch.compile(fullgraph=True)``, no graph break; the real one refuses
  a format that is not the op's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.core.test_launch_wiring_cpu import CPU, Kernels, Order

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: 5 groups of 128 (a partial last word of packed scales), 20 of 32; 80 fragments, two CTAs of 64.
HIDDEN, HC, TOP_K, CAPACITY = 640, 4, 2, 160
#: M = 3: padding rows of both UE8M0 layouts; 130: a second 128-row tile of the swizzled one.
TOKENS = (3, 130)
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


GOOD = dict(hidden_size=5120, hc_mult=4, max_num_tokens=8, top_k=8, device="cuda:0")


@pytest.mark.parametrize(
    "fmt, both", [("bf16", False), *((fmt, both) for fmt in FORMATS for both in (False, True))]
)  # bf16 with the BF16 copy beside it is refused (below)
def test_every_format_reaches_the_build(no_build, fmt: str, both: bool) -> None:
    from mhc_dsv41 import AllReduceMHC

    with pytest.raises(BuildStarted):
        AllReduceMHC(**GOOD, layer_input_format=fmt, layer_input_bf16=both)


BAD_OPTIONS = [
    (dict(layer_input_format="fp8"), ValueError, "layer_input_format: expected one of bf16, fp32-g128"),
    (dict(layer_input_format="FP32-G128"), ValueError, "layer_input_format: expected one of"),
    (dict(layer_input_format=None), TypeError, "layer_input_format: expected a str"),
    (dict(layer_input_format=128), TypeError, "layer_input_format: expected a str, .* got int 128"),
    (dict(layer_input_format="mx-g32", layer_input_bf16=1), TypeError, "layer_input_bf16: expected a bool, got int"),
    (dict(layer_input_format="mx-g32", layer_input_bf16="yes"), TypeError, "layer_input_bf16: expected a bool"),
    (dict(layer_input_bf16=True), ValueError, "layer_input_bf16: .*expected False"),
    # 5184 = 40.5 groups of 128 (a whole number of 32-column groups); 5000 = 156.25 groups of 32.
    (dict(hidden_size=5184, layer_input_format="fp32-g128"), ValueError, "layer_input_format: .*hidden_size = 5184"),
    (dict(hidden_size=5184, layer_input_format="ue8m0-g128-packed"), ValueError, "layer_input_format: .*of 128"),
    (dict(hidden_size=5000, layer_input_format="mx-g32"), ValueError, "layer_input_format: .*multiple of 32"),
]


@pytest.mark.parametrize("change, error, message", BAD_OPTIONS)
def test_bad_options_name_their_argument(no_build, change: dict, error: type, message: str) -> None:
    from mhc_dsv41 import AllReduceMHC

    with pytest.raises(error, match=f"^{message}"):
        AllReduceMHC(**{**GOOD, **change})


def test_hidden_5184_takes_the_32_column_groups(no_build) -> None:
    from mhc_dsv41 import AllReduceMHC

    with pytest.raises(BuildStarted):
        AllReduceMHC(**{**GOOD, "hidden_size": 5184}, layer_input_format="mx-g32")


def test_from_config_takes_the_presets_option_and_an_explicit_one_replaces_it(monkeypatch) -> None:
    from mhc_dsv41 import AllReduceMHC, presets

    seen = []

    def fake_build(self, preset, **options):  # the one path every op takes, from its preset
        seen.append({key: getattr(preset, key) for key in ("layer_input_format", "layer_input_bf16")})

    monkeypatch.setattr(AllReduceMHC, "_init_from_preset", lambda self, preset, **options: None)
    monkeypatch.setattr(AllReduceMHC, "_build", lambda self, preset, *args, **options: fake_build(self, preset))
    preset = dataclasses.replace(
        presets.get("h200-tp1-h5120").PRESET, layer_input_format="ue8m0-g128-packed", layer_input_bf16=True
    )
    AllReduceMHC.from_config(preset, max_num_tokens=8, device="cuda")
    AllReduceMHC.from_config(preset, max_num_tokens=8, device="cuda", layer_input_format="mx-g32")
    AllReduceMHC.from_config(preset, max_num_tokens=8, device="cuda", layer_input_bf16=False)
    AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=8, device="cuda", layer_input_format="fp32-g128")
    AllReduceMHC.from_preset("h200-tp1-h5120", max_num_tokens=8, device="cuda")
    assert seen == [
        {"layer_input_format": "ue8m0-g128-packed", "layer_input_bf16": True},
        {"layer_input_format": "mx-g32", "layer_input_bf16": False},  # the format given: not the preset's copy
        {"layer_input_format": "ue8m0-g128-packed", "layer_input_bf16": False},
        {"layer_input_format": "fp32-g128", "layer_input_bf16": False},
        {"layer_input_format": "bf16", "layer_input_bf16": False},
    ]


# ------------------------------------------------------------------ presets
def test_presets_validate_the_option() -> None:
    from mhc_core.presets import PresetError
    from mhc_dsv41 import presets

    preset = presets.get("h200-tp1-h5120").PRESET
    assert (preset.layer_input_format, preset.layer_input_bf16) == ("bf16", False)
    bad = [
        (dict(layer_input_format="e4m3"), "layer_input_format", "expected one of"),
        (dict(layer_input_format="mx-g32", layer_input_bf16="true"), "layer_input_bf16", "True or False"),
        (dict(layer_input_bf16=True), "layer_input_bf16", "expected False"),
        (dict(hidden=5184, layer_input_format="fp32-g128"), "layer_input_format", "multiple of 128"),
        (dict(tp=2, rank_lanes=2, layer_input_format="mx-g32"), None, None),  # 4 fragments x 2 lanes: fine
        (dict(tp=4, rank_lanes=4, layer_input_format="fp32-g128"), "rank_lanes", "at most 2 rank lanes"),
    ]
    for change, key, rule in bad:
        fields = {**{f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}, **change}
        if key is None:
            type(preset)(**fields)
            continue
        with pytest.raises(PresetError, match=f"^key {key!r}: .*{rule}") as raised:
            type(preset)(**fields)
        assert raised.value.key == key


@pytest.mark.parametrize("both", (False, True))
def test_a_presets_kernels_are_its_formats_collectives(both: bool) -> None:
    from mhc_dsv41 import presets
    from mhc_dsv41.config import MHCConfig

    base = presets.get("h200-tp2-h5120").PRESET
    preset = dataclasses.replace(base, layer_input_format="mx-g32", layer_input_bf16=both)
    specs = preset.kernel_specs("sm_90a")
    for name in ("collective", "collective_persistent"):
        config = MHCConfig(**specs[name][1])
        assert (config.layer_input_format, config.layer_input_bf16) == ("mx-g32", both)
        assert config.persistent == (name == "collective_persistent")
    plain = base.kernel_specs("sm_90a")
    assert {k: v for k, v in specs.items() if not k.startswith("collective")} == {
        k: v for k, v in plain.items() if not k.startswith("collective")
    }, "the publishes do not depend on the format"
    # An explicit format (the tests' way to build one preset's FP8 kernels) still wins.
    assert base.collective_config(layer_input_format="fp32-g128")["layer_input_format"] == "fp32-g128"
    assert preset.collective_config(layer_input_format="bf16")["layer_input_bf16"] is False


def test_codegen_validates_and_renders_the_option(tmp_path) -> None:
    from codegen.load import CodegenError, load_presets
    from codegen.render import environment, render_preset

    table = """
[dsv41.h200-tp1-h5120-fp8]
hidden = 5120
hc = 4
tp = 1
top_k = 8
norm_eps = 1e-6
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
    assert text.count('"layer_input_format": "ue8m0-g128-packed"') == 2, "both collectives"
    for fmt, both, key in (("fp8", "false", "layer_input_format"), ("bf16", "true", "layer_input_bf16")):
        path.write_text(table.format(fmt=fmt, both=both))
        with pytest.raises(CodegenError, match=rf"\[dsv41.h200-tp1-h5120-fp8\] key '{key}': "):
            load_presets(path)


# ------------------------------------------------------------------ the call (recorder kernels)
def fp8_op(tp: int, fmt: str, both: bool):
    """An ``AllReduceMHC`` as construction leaves it, on the CPU, with recorder kernels (the
    collectives' real signatures: FP8 ones append ``layer_input_q`` and ``layer_input_scales``)."""
    from types import SimpleNamespace

    from mhc_core.device.publish import FinalizePublishKernel, PublishConfig, PublishKernel
    from mhc_core.host.layer_input import LayerInput
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.config import CollectiveTarget, collective_routing
    from mhc_dsv41.kernel import LamportMHCKernel, MHCConfig

    kernels = Kernels()
    op = object.__new__(AllReduceMHC)
    publish = dict(hidden=HIDDEN, tp=tp, threads=128, trigger="after_stores", store="unicast")
    config = MHCConfig(
        hidden=HIDDEN, hc=HC, tp=tp, cluster_size=2, threads=64, rank_lanes=1, layer_input_format=fmt,
        layer_input_bf16=both,
    )  # fmt: skip
    op.__dict__.update(
        hidden_size=HIDDEN, device=CPU, tp=tp, rank=0, capacity=CAPACITY, top_k=TOP_K, check_routes=False,
        _closed=False, _peers_ready=True, _pending_m=None, _order=Order(),
        group=SimpleNamespace(kind="none", missing_peers=lambda op: []),
        spin=SimpleNamespace(limit_ns=5, address=1234, checks_token_counts=False, check=lambda: None),
        mailbox=SimpleNamespace(
            buffer=torch.zeros(64, dtype=torch.bfloat16), stage_state=torch.zeros(4, dtype=torch.int32),
            destinations=torch.zeros(tp, dtype=torch.int64),
        ),
        _publish_kernel=kernels.compiled("publish", PublishKernel(PublishConfig(**publish))),
        _finalize_kernels={
            torch.float32: kernels.compiled(
                "finalize", FinalizePublishKernel(PublishConfig(**publish, top_k=TOP_K, weights="float32"))
            )
        },
        hc_mult=HC, norm_eps=1e-6, clusters=7, persistent_min_tokens=128, config=config,
        routing=collective_routing(128),
        layer_input=LayerInput.checked(fmt, both, HIDDEN), _quantizes=fmt != "bf16",
        _collective_kernels={
            CollectiveTarget(False): kernels.compiled("collective", LamportMHCKernel(config)),
            CollectiveTarget(True): kernels.compiled(
                "collective_persistent", LamportMHCKernel(dataclasses.replace(config, persistent=True))
            ),
        },
    )  # fmt: skip
    op._init_call_state()
    op._programs = op._build_programs()
    return op, kernels


def collect_args(m: int) -> tuple:
    return (
        torch.randn(m, HC, HIDDEN).to(torch.bfloat16), torch.rand(m, HC), torch.rand(m, HC, HC), torch.rand(m, HC),
        torch.ones(HIDDEN, dtype=torch.bfloat16),
    )  # fmt: skip


def moe(m: int) -> tuple:
    rows = m * TOP_K
    return (
        torch.randn(rows, HIDDEN).to(torch.bfloat16), torch.rand(m, TOP_K),
        torch.arange(rows, dtype=torch.int32).view(m, TOP_K), torch.randn(m, HIDDEN).to(torch.bfloat16),
    )  # fmt: skip


def expected_outputs(fmt: str, both: bool, m: int) -> list[tuple]:
    """(dtype, shape, strides, storage elements) of each output, from ``mhc_core.fp8``."""
    from mhc_core import fp8

    layout = fp8.get_format(fmt)
    outputs = [
        (torch.bfloat16, (m, HC, HIDDEN), (HC * HIDDEN, HIDDEN, 1), m * HC * HIDDEN),
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


def check_returned(returned: tuple, kernels: Kernels, fmt: str, both: bool, m: int) -> None:
    specs = expected_outputs(fmt, both, m)
    assert isinstance(returned, tuple) and len(returned) == len(specs)
    for index, (tensor, (dtype, shape, strides, storage)) in enumerate(zip(returned, specs, strict=True)):
        assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (dtype, shape, strides), index
        assert tensor.untyped_storage().nbytes() == storage * tensor.element_size(), f"output {index}: allocation"
    values = kernels.calls[-1][1]
    assert values["residual_out"] == returned[0].data_ptr()
    assert values["layer_input_q"] == returned[1].data_ptr()
    assert values["layer_input_scales"] == returned[2].data_ptr()
    # FP8 alone: the kernel writes no BF16 layer input (any aligned address: q's).
    assert values["layer_input"] == returned[3 if both else 1].data_ptr()
    assert values["m"] == m


@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", (1, 2))
def test_every_call_form_returns_the_formats_outputs(tp: int, fmt: str, both: bool) -> None:
    op, kernels = fp8_op(tp, fmt, both)
    for m in TOKENS:
        x = torch.randn(m, HIDDEN).to(torch.bfloat16)
        args = collect_args(m)
        check_returned(op(x, *args), kernels, fmt, both, m)
        assert kernels.names()[-1] == ("collective_persistent" if m >= 128 else "collective")
        check_returned(op.finalize(*moe(m), *args), kernels, fmt, both, m)
        assert kernels.names()[-2:] == ["finalize", kernels.names()[-1]]
        op.publish(x)
        check_returned(op.collect(*args), kernels, fmt, both, m)


@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_is_written_in_place(fmt: str, both: bool) -> None:
    from mhc_core import fp8

    op, kernels = fp8_op(1, fmt, both)
    m = TOKENS[0]
    x = torch.randn(m, HIDDEN).to(torch.bfloat16)
    args = collect_args(m)
    out = [torch.empty(m, HC, HIDDEN, dtype=torch.bfloat16), torch.empty(m, HIDDEN, dtype=F8)]
    out.append(fp8.get_format(fmt).empty_scales(m, HIDDEN))
    if both:
        out.append(x)  # the BF16 copy may be x itself, as the BF16 layer input may
    returned = op(x, *args, out=tuple(out))
    assert all(a is b for a, b in zip(returned, out, strict=True))
    check_returned(returned, kernels, fmt, both, m)
    op.publish(x)
    assert all(a is b for a, b in zip(op.collect(*args, out=out), out, strict=True)), "a list is taken too"


def bad_calls(fmt: str, m: int) -> dict:
    """Per case, ``(x, collect args, out) -> (x, collect args, out)`` changed, the error and its message;
    out[2] is the scales (M = ``m``)."""
    from mhc_core import fp8

    layout = fp8.get_format(fmt)
    shape, strides, words = layout.scale_shape(m, HIDDEN), layout.scale_strides(m, HIDDEN), None
    scales = r"out\[2\] \(layer_input_scales\)"

    def replace(index: int, tensor: torch.Tensor):
        return lambda x, args, out: (x, args, [*out[:index], tensor, *out[index + 1 :]])

    def q_inside_x(x, args, out):
        return x, args, [out[0], x.view(-1).view(torch.uint8)[: m * HIDDEN].view(F8).view(m, HIDDEN), out[2]]

    cases = {
        "arity": (
            lambda x, args, out: (x, args, out[:2]),
            TypeError,
            r"out: expected a \(residual_out, layer_input_q, layer_input_scales\) tuple of 3 tensors",
        ),
        "q dtype": (
            replace(1, torch.empty(m, HIDDEN, dtype=torch.uint8)),
            TypeError,
            r"out\[1\] \(layer_input_q\): expected dtype float8_e4m3fn, got uint8",
        ),
        "q shape": (
            replace(1, torch.empty(m + 1, HIDDEN, dtype=F8)),
            ValueError,
            rf"out\[1\] \(layer_input_q\): expected shape \[{m}, {HIDDEN}\]",
        ),
        "q inside x": (
            q_inside_x,
            ValueError,
            r"out\[1\] \(layer_input_q\): expected memory of its own.*overlapping x",
        ),
        "scale dtype": (
            replace(2, torch.empty(shape, dtype=torch.float16)),
            TypeError,
            f"{scales}: expected dtype {str(layout.scale_dtype).replace('torch.', '')}, got float16",
        ),
        "scales of another M": (
            replace(2, layout.empty_scales(m + 128, HIDDEN)),
            ValueError,
            f"{scales}: expected shape",
        ),
    }
    if fmt == "ue8m0-g128-packed":
        words = layout.scale_storage_numel(m, HIDDEN)
        cases["contiguous scales"] = (
            replace(2, torch.empty(shape, dtype=torch.int32)),
            ValueError,
            rf"{scales}: expected strides \(1, {strides[1]}\), got \({shape[1]}, 1\)",
        )
        # A view whose own bounds hold: the kernel's padding rows (M .. align(M, 4)) would not fit.
        cases["storage without the padding rows"] = (
            replace(2, torch.empty(words - 1, dtype=torch.int32).as_strided(shape, strides)),
            ValueError,
            f"{scales}: expected a storage of at least {words} int32 elements",
        )

        def pre_in_the_padding(x, args, out):
            # pre right after the scales' view (word (P - 1) * align(M, 4) + M): outside the view, inside
            # the padding rows the kernel writes.
            view_words = (shape[1] - 1) * strides[1] + m
            shared = torch.empty(words + m * HC, dtype=torch.int32)
            pre = shared[view_words : view_words + m * HC].view(torch.float32).view(m, HC)
            return x, (*args[:3], pre, args[4]), [*out[:2], shared[:words].as_strided(shape, strides)]

        cases["padding rows over pre"] = (
            pre_in_the_padding,
            ValueError,
            f"{scales}: expected memory of its own, got a tensor overlapping pre",
        )
    return cases


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_out_is_refused_before_any_launch(fmt: str) -> None:
    from mhc_core import fp8

    op, kernels = fp8_op(2, fmt, False)
    m = TOKENS[0]
    for case, (change, error, message) in bad_calls(fmt, m).items():
        good = [
            torch.empty(m, HC, HIDDEN, dtype=torch.bfloat16), torch.empty(m, HIDDEN, dtype=F8),
            fp8.get_format(fmt).empty_scales(m, HIDDEN),
        ]  # fmt: skip
        x, args, out = change(torch.randn(m, HIDDEN).to(torch.bfloat16), collect_args(m), good)
        with pytest.raises(error, match=message):
            op(x, *args, out=out)
        if case != "q inside x":  # a plan's collect comes after its publish has copied x
            with pytest.raises(error, match=message):
                op.plan("call", x, *args, out=out)
        assert kernels.calls == [], f"{case}: a kernel was launched"
    op(torch.randn(m, HIDDEN).to(torch.bfloat16), *collect_args(m))  # still usable
    assert kernels.names() == ["publish", "collective"]


def test_bf16_ops_keep_their_outputs() -> None:
    """The default option's programs are the BF16 op's: two outputs, contiguous, no storage rule."""
    op, kernels = fp8_op(1, "bf16", False)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    _, layer_input = op(x, *collect_args(3))
    assert layer_input.dtype == torch.bfloat16 and layer_input.shape == (3, HIDDEN)
    assert "layer_input_q" not in kernels.calls[-1][1]
    assert not op._programs.call.sized_outputs and [r.name for r in op._programs.call.outputs] == [
        "out[0] (residual_out)",
        "out[1] (layer_input)",
    ]


# ------------------------------------------------------------------ the custom ops
def traced(function, *args, dynamic: bool = False):
    """``torch.compile(fullgraph=True)`` through a backend that keeps Dynamo's graph (one: no break)."""
    import mhc_dsv41.library  # noqa: F401  (registers the ops)

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
        ((4,), torch.int32), ((m, HIDDEN), torch.bfloat16), ((m, HC, HIDDEN), torch.bfloat16), ((m, HC), torch.float32),
        ((m, HC, HC), torch.float32), ((m, HC), torch.float32), ((HIDDEN,), torch.bfloat16),
        ((2 * m, HIDDEN), torch.bfloat16), ((m, TOP_K), torch.float32), ((m, TOP_K), torch.int32),
    )  # fmt: skip
    with mode:
        return [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in shapes]


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_outputs_are_the_formats(fmt: str, both: bool, dynamic: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    def layer(state, x, residual, post, comb, pre, weight, gemm2, weights, index):
        first = torch.ops.mhc.dsv41_boundary_fp8(state, 3, x, residual, post, comb, pre, weight, 1e-6, fmt, both)
        second = torch.ops.mhc.dsv41_finalize_fp8(
            state, 3, gemm2, weights, index, x, first[0], post, comb, pre, weight, 1e-6, fmt, both
        )
        torch.ops.mhc.publish(state, 3, x)
        third = torch.ops.mhc.dsv41_collect_fp8(state, 3, second[0], post, comb, pre, weight, 1e-6, fmt, both)
        return first, second, third

    for m in TOKENS:
        mode = FakeTensorMode()
        inputs = fake_inputs(mode, m)
        with mode:
            results, calls = traced(layer, *inputs, dynamic=dynamic)
        assert calls == ["dsv41_boundary_fp8", "dsv41_finalize_fp8", "publish", "dsv41_collect_fp8"]
        for outputs in results:
            specs = expected_outputs(fmt, both, m)
            if not both:  # the custom ops return four outputs, the last empty (LayerInput.op_outputs)
                specs = [*specs, (torch.bfloat16, (0,), (1,), None)]
            assert len(outputs) == len(specs)
            for tensor, (dtype, shape, strides, _) in zip(outputs, specs, strict=True):
                assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (dtype, shape, strides)
                assert tensor.device.type == "cuda"


def test_the_wrappers_pick_the_ops_by_the_ops_format() -> None:
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhc_core.host.layer_input import LayerInput
    from mhc_dsv41 import library

    mode = FakeTensorMode()
    state, x, residual, post, comb, pre, weight, *_ = fake_inputs(mode, 5)
    for fmt, both, count in (("bf16", False, 2), ("mx-g32", False, 3), ("fp32-g128", True, 4)):
        op = SimpleNamespace(state=state, handle=9, norm_eps=1e-6, layer_input=LayerInput(fmt, both))

        def layer(state, x, residual, post, comb, pre, weight, op=op):
            outputs = library.boundary(op, x, residual, post, comb, pre, weight)
            torch.ops.mhc.publish(state, 9, x)
            return outputs, library.collect(op, outputs[0], post, comb, pre, weight)

        with mode:
            (called, collected), calls = traced(layer, state, x, residual, post, comb, pre, weight)
        suffix = "_fp8" if fmt != "bf16" else ""
        assert calls == [f"dsv41_boundary{suffix}", "publish", f"dsv41_collect{suffix}"]
        assert isinstance(called, tuple) and len(called) == len(collected) == count


def test_the_real_op_refuses_another_format() -> None:
    """The fake derives the outputs from the arguments: the real op checks they are its own."""
    from mhc_core.host import library as core_library
    from mhc_dsv41 import library

    op, kernels = fp8_op(1, "mx-g32", False)
    handle = core_library.register(op)
    try:
        args = (torch.randn(3, HIDDEN).to(torch.bfloat16), *collect_args(3), 1e-6)
        with pytest.raises(ValueError, match=r"layer_input_format: the op behind handle \d+ writes 'mx-g32'"):
            library._run_fp8(handle, op.state, "fp32-g128", False, lambda op: op(*args))
        assert kernels.calls == []
        outputs = library._run_fp8(handle, op.state, "mx-g32", False, lambda op: op(*args))
        assert isinstance(outputs, tuple) and len(outputs) == 4 and outputs[1].dtype == F8
        assert outputs[3].numel() == 0  # the BF16 layer input not kept: an empty fourth output
    finally:
        core_library.unregister(handle)
