"""The FP8 layer-input option of a fused op (issue #33) without a GPU, once for both models (issue #50).

A model's test file (``tests/dsv41/test_fp8_op_cpu.py``, ``tests/glm5/test_fp8_op_cpu.py``) derives a
test class from ``Fp8OpCases`` (every test below) with a ``model`` fixture returning its ``Fp8Model``:
pytest runs them there, against that model.

* The constructor: every format (and the BF16 copy beside it) reaches the build; a bad name, type
  or hidden size raises naming the argument before any compile; ``from_config`` / ``from_preset``
  take a preset's option, and an explicit one replaces it. Codegen validates and renders it.
* The call, through the real native programs on CPU tensors with recorder kernels (as
  ``tests.core.test_launch_wiring_cpu``): the plain call, the MoE call and ``collect`` return the
  op's outputs up to the layer input, then ``(q, scales[, layer_input])`` with ``mhc_core.fp8``'s
  dtypes, shapes, strides and allocations, and hand the collective those addresses; ``out=`` in the
  same order is written in place; a wrong ``out=`` (arity, dtype, shape, strides, a storage too small
  for the padding rows, an overlap) is refused naming the output before any launch.
* The custom ops: their fake implementations give every format's outputs (a symbolic M too) under
  ``torch.compile(fullgraph=True)``, no graph break; the wrappers pick the ops by the op's format;
  the real op refuses a format that is not its own.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.library.test_trace_cpu import traced

FORMATS = ("fp32-g128", "ue8m0-g128-packed", "mx-g32")
#: 5 groups of 128 (a partial last word of packed scales), 20 of 32; 80 fragments.
HIDDEN, HC, MIX, TOP_K, CAPACITY = 640, 4, 24, 2, 160
#: M = 3: padding rows of both UE8M0 layouts; 130: a second 128-row tile of the swizzled one.
TOKENS = (3, 130)
F8 = torch.float8_e4m3fn
#: A tensor to make: ``(shape, dtype)``.
Spec = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Fp8Model:
    """What the shared tests need of one model."""

    #: The package (``mhc_dsv41``) and its op class's name.
    package: str
    op_class: str
    #: Constructor arguments that build a valid op (the build itself never starts), and what the
    #: format cases add to them.
    good: dict[str, Any]
    #: Bad constructor options beyond the shared ones: ``(change, error, message)``.
    bad_options: list[tuple[dict[str, Any], type, str]]
    #: A hidden size that takes 32-column groups only.
    hidden_32_only: int
    #: A generated preset of tp = 1, and a ``presets.toml`` table of an FP8 preset (``{fmt}``, ``{both}``)
    #: with the number of kernels that write its format.
    preset: str
    table: str
    fp8_kernels: int
    #: An op as construction leaves it on the CPU, with recorder kernels: ``(tp, fmt, both) -> (op, Kernels)``.
    fp8_op: Callable[[int, str, bool], tuple[Any, Any]]
    #: The collective's parameters after the input for M tokens (``make(shape, dtype)`` gives each
    #: tensor; floats as they are).
    params: Callable[[int, Callable[[tuple[int, ...], torch.dtype], torch.Tensor]], list[Any]]
    #: The outputs before the layer input's: names and ``(dtype, shape)`` for M.
    first_outputs: tuple[str, ...]
    first_specs: Callable[[int], list[Spec]]
    #: The collective kernel a call of M tokens launches, and the kernels launched after it.
    collective_for: Callable[[int], str]
    after_collective: tuple[str, ...] = ()
    #: A float parameter the scales' padding rows may not overlap: ``(index in params, name)``.
    float_param: tuple[int, str] = (1, "post")
    #: Checks of a call's side launches (``(returned, kernels, op)``).
    check_side: Callable[[tuple, Any, Any], None] | None = None

    def module(self, name: str = "") -> Any:
        return importlib.import_module(f"{self.package}{'.' + name if name else ''}")

    @property
    def cls(self) -> Any:
        return getattr(self.module(), self.op_class)

    @property
    def prefix(self) -> str:
        return self.package.removeprefix("mhc_")


def random(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def moe(m: int) -> Any:
    from mhc_core import MoEOutput

    rows = m * TOP_K
    return MoEOutput(
        random((rows, HIDDEN), torch.bfloat16), torch.rand(m, TOP_K),
        torch.arange(rows, dtype=torch.int32).view(m, TOP_K), random((m, HIDDEN), torch.bfloat16),
    )  # fmt: skip


# ------------------------------------------------------------------ the constructor
class BuildStarted(Exception):
    """Raised where construction leaves validation (the arch is read): every check has passed."""


@pytest.mark.parametrize("fmt, both", [("bf16", False), *((fmt, both) for fmt in FORMATS for both in (False, True))])
def test_every_format_reaches_the_build(model: Fp8Model, no_build, fmt: str, both: bool) -> None:
    with pytest.raises(BuildStarted):
        model.cls(**model.good, layer_input_format=fmt, layer_input_bf16=both)


#: Every model's: the option's own rules (``mhc_core.fp8_formats.require_layer_input``).
BAD_OPTIONS = [
    (dict(layer_input_format="fp8"), ValueError, "layer_input_format: expected one of bf16, fp32-g128"),
    (dict(layer_input_format="FP32-G128"), ValueError, "layer_input_format: expected one of"),
    (dict(layer_input_format=None), TypeError, "layer_input_format: expected a str, one of bf16, .*; got None"),
    (dict(layer_input_format=128), TypeError, "layer_input_format: expected a str, .*; got 128"),
    (dict(layer_input_format="mx-g32", layer_input_bf16=1), TypeError, "layer_input_bf16: expected a bool"),
    (dict(layer_input_format="mx-g32", layer_input_bf16="yes"), TypeError, "layer_input_bf16: expected a bool"),
    (dict(layer_input_bf16=True), ValueError, "layer_input_bf16: .*expected False"),
]


def test_bad_options_name_their_argument(model: Fp8Model, no_build) -> None:
    for change, error, message in BAD_OPTIONS + model.bad_options:
        with pytest.raises(error, match=f"^{message}"):
            model.cls(**{**model.good, **change})


def test_a_hidden_size_of_32_column_groups_only_takes_them(model: Fp8Model, no_build) -> None:
    with pytest.raises(BuildStarted):
        model.cls(**{**model.good, "hidden_size": model.hidden_32_only}, layer_input_format="mx-g32")


def test_from_config_takes_the_presets_option_and_an_explicit_one_replaces_it(model: Fp8Model, monkeypatch) -> None:
    cls, presets = model.cls, model.module("presets")
    seen = []

    def fake_build(self, preset, **options):  # the one path every op takes, from its preset
        seen.append({key: getattr(preset, key) for key in ("layer_input_format", "layer_input_bf16")})

    monkeypatch.setattr(cls, "_init_from_preset", lambda self, preset, **options: None)
    monkeypatch.setattr(cls, "_build", lambda self, preset, *args, **options: fake_build(self, preset))
    preset = dataclasses.replace(
        presets.get(model.preset).PRESET, layer_input_format="ue8m0-g128-packed", layer_input_bf16=True
    )
    cls.from_config(preset, max_num_tokens=8, device="cuda")
    cls.from_config(preset, max_num_tokens=8, device="cuda", layer_input_format="mx-g32")
    cls.from_config(preset, max_num_tokens=8, device="cuda", layer_input_bf16=False)
    cls.from_preset(model.preset, max_num_tokens=8, device="cuda", layer_input_format="fp32-g128")
    cls.from_preset(model.preset, max_num_tokens=8, device="cuda")
    assert seen == [
        {"layer_input_format": "ue8m0-g128-packed", "layer_input_bf16": True},
        {"layer_input_format": "mx-g32", "layer_input_bf16": False},  # the format given: not the preset's copy
        {"layer_input_format": "ue8m0-g128-packed", "layer_input_bf16": False},
        {"layer_input_format": "fp32-g128", "layer_input_bf16": False},
        {"layer_input_format": "bf16", "layer_input_bf16": False},
    ]


def test_one_rule_names_a_bad_option_alike_wherever_it_enters(model: Fp8Model, no_build) -> None:
    """The constructor, ``from_config`` and a preset apply one rule (``require_layer_input``), before
    the device is touched: one message for one mistake (issue #50: three checks, three wordings)."""
    from mhc_core.presets import PresetError

    preset = model.module("presets").get(model.preset).PRESET
    bad = dict(layer_input_format="mx-g32", layer_input_bf16=1)
    messages = []
    with pytest.raises(TypeError) as raised:
        model.cls(**model.good, **bad)
    messages.append(str(raised.value))
    with pytest.raises(TypeError) as raised:
        model.cls.from_config(preset, max_num_tokens=8, device="cuda", **bad)
    messages.append(str(raised.value))
    with pytest.raises(PresetError) as raised:
        dataclasses.replace(preset, **bad)
    assert isinstance(raised.value, TypeError)
    messages.append(f"{raised.value.key}: {raised.value.rule}; got {raised.value.value!r}")
    assert messages == ["layer_input_bf16: expected a bool (True or False); got 1"] * 3


def test_codegen_validates_and_renders_the_option(model: Fp8Model, tmp_path) -> None:
    from codegen.load import CodegenError, load_presets
    from codegen.render import environment, render_preset

    path = tmp_path / "presets.toml"
    path.write_text(model.table.format(fmt="ue8m0-g128-packed", both="true"))
    (preset,) = load_presets(path)
    assert (preset.value.layer_input_format, preset.value.layer_input_bf16) == ("ue8m0-g128-packed", True)
    text = render_preset(environment(), preset, "presets.toml")
    assert 'layer_input_format="ue8m0-g128-packed",' in text and "layer_input_bf16=True," in text
    assert text.count('"layer_input_format": "ue8m0-g128-packed"') == model.fp8_kernels, "every collective"
    table = model.table.split("]")[0].lstrip("\n[")
    for fmt, both, key in (("fp8", "false", "layer_input_format"), ("bf16", "true", "layer_input_bf16")):
        path.write_text(model.table.format(fmt=fmt, both=both))
        with pytest.raises(CodegenError, match=rf"\[{table}\] key '{key}': "):
            load_presets(path)


# ------------------------------------------------------------------ the call (recorder kernels)
def expected_outputs(model: Fp8Model, fmt: str, both: bool, m: int) -> list[tuple]:
    """(dtype, shape, strides, storage elements) of each output, from ``mhc_core.fp8``."""
    from mhc_core import fp8

    def contiguous(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple:
        strides = tuple(int(torch.tensor(shape[i + 1 :]).prod()) for i in range(len(shape)))
        return (dtype, shape, strides, int(torch.tensor(shape).prod()))

    layout = fp8.get_format(fmt)
    outputs = [contiguous(dtype, shape) for dtype, shape in model.first_specs(m)]
    outputs.append(contiguous(F8, (m, HIDDEN)))
    outputs.append(
        (
            layout.scale_dtype,
            layout.scale_shape(m, HIDDEN),
            layout.scale_strides(m, HIDDEN),
            layout.scale_storage_numel(m, HIDDEN),
        )
    )
    if both:
        outputs.append(contiguous(torch.bfloat16, (m, HIDDEN)))
    return outputs


def check_returned(model: Fp8Model, returned: tuple, op: Any, kernels: Any, fmt: str, both: bool, m: int) -> None:
    specs = expected_outputs(model, fmt, both, m)
    assert isinstance(returned, tuple) and len(returned) == len(specs)
    for index, (tensor, (dtype, shape, strides, storage)) in enumerate(zip(returned, specs, strict=True)):
        assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (dtype, shape, strides), index
        assert tensor.untyped_storage().nbytes() == storage * tensor.element_size(), f"output {index}: allocation"
    first = len(model.first_outputs)
    name, values = kernels.calls[-1 - len(model.after_collective)]
    assert name == model.collective_for(m)
    assert values["residual_out"] == returned[0].data_ptr()
    assert values["layer_input_q"] == returned[first].data_ptr()
    assert values["layer_input_scales"] == returned[first + 1].data_ptr()
    # FP8 alone: the kernel writes no BF16 layer input (any aligned address: q's).
    assert values["layer_input"] == returned[first + 2 if both else first].data_ptr()
    assert values["m"] == m
    if model.check_side is not None:
        model.check_side(returned, kernels, op)


@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", (1, 2))
def test_every_call_form_returns_the_formats_outputs(model: Fp8Model, tp: int, fmt: str, both: bool) -> None:
    op, kernels = model.fp8_op(tp, fmt, both)
    for m in TOKENS:
        x = random((m, HIDDEN), torch.bfloat16)
        args = model.params(m, random)
        check_returned(model, op(x, *args), op, kernels, fmt, both, m)
        check_returned(model, op(moe(m), *args), op, kernels, fmt, both, m)
        assert kernels.names()[-2 - len(model.after_collective)] == "finalize"
        op.publish(x)
        check_returned(model, op.collect(*args), op, kernels, fmt, both, m)


def good_out(model: Fp8Model, fmt: str, m: int) -> list[torch.Tensor]:
    from mhc_core import fp8

    first = [torch.empty(shape, dtype=dtype) for dtype, shape in model.first_specs(m)]
    return [*first, torch.empty(m, HIDDEN, dtype=F8), fp8.get_format(fmt).empty_scales(m, HIDDEN)]


@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_out_is_written_in_place(model: Fp8Model, fmt: str, both: bool) -> None:
    op, kernels = model.fp8_op(1, fmt, both)
    m = TOKENS[0]
    x = random((m, HIDDEN), torch.bfloat16)
    args = model.params(m, random)
    out = good_out(model, fmt, m)
    if both:
        out.append(x)  # the BF16 copy may be x itself, as the BF16 layer input may
    returned = op(x, *args, out=tuple(out))
    assert all(a is b for a, b in zip(returned, out, strict=True))
    check_returned(model, returned, op, kernels, fmt, both, m)
    op.publish(x)
    assert all(a is b for a, b in zip(op.collect(*args, out=out), out, strict=True)), "a list is taken too"


def bad_calls(model: Fp8Model, fmt: str, m: int) -> dict:
    """Per case, ``(x, params, out) -> (x, params, out)`` changed, the error and its message."""
    from mhc_core import fp8

    layout = fp8.get_format(fmt)
    shape, strides = layout.scale_shape(m, HIDDEN), layout.scale_strides(m, HIDDEN)
    q_index = len(model.first_outputs)
    q, scales = rf"out\[{q_index}\] \(layer_input_q\)", rf"out\[{q_index + 1}\] \(layer_input_scales\)"

    def replace(index: int, tensor: torch.Tensor):
        return lambda x, args, out: (x, args, [*out[:index], tensor, *out[index + 1 :]])

    def q_inside_x(x, args, out):
        return x, args, [*out[:q_index], x.view(-1).view(torch.uint8)[: m * HIDDEN].view(F8).view(m, HIDDEN), out[-1]]

    names = ", ".join((*model.first_outputs, "layer_input_q", "layer_input_scales"))
    cases = {
        "arity": (
            lambda x, args, out: (x, args, out[:-1]),
            TypeError,
            rf"out: expected a \({names}\) tuple of {q_index + 2} tensors",
        ),
        "q dtype": (
            replace(q_index, torch.empty(m, HIDDEN, dtype=torch.uint8)),
            TypeError,
            f"{q}: expected dtype float8_e4m3fn, got uint8",
        ),
        "q shape": (
            replace(q_index, torch.empty(m + 1, HIDDEN, dtype=F8)),
            ValueError,
            rf"{q}: expected shape \[{m}, {HIDDEN}\]",
        ),
        "q inside x": (q_inside_x, ValueError, f"{q}: expected memory of its own.*overlapping x"),
        "scale dtype": (
            replace(q_index + 1, torch.empty(shape, dtype=torch.float16)),
            TypeError,
            f"{scales}: expected dtype {str(layout.scale_dtype).replace('torch.', '')}, got float16",
        ),
        "scales of another M": (
            replace(q_index + 1, layout.empty_scales(m + 128, HIDDEN)),
            ValueError,
            f"{scales}: expected shape",
        ),
    }
    if fmt == "ue8m0-g128-packed":
        words = layout.scale_storage_numel(m, HIDDEN)
        cases["contiguous scales"] = (
            replace(q_index + 1, torch.empty(shape, dtype=torch.int32)),
            ValueError,
            rf"{scales}: expected strides \(1, {strides[1]}\), got \({shape[1]}, 1\)",
        )
        # A view whose own bounds hold: the kernel's padding rows (M .. align(M, 4)) would not fit.
        cases["storage without the padding rows"] = (
            replace(q_index + 1, torch.empty(words - 1, dtype=torch.int32).as_strided(shape, strides)),
            ValueError,
            f"{scales}: expected a storage of at least {words} int32 elements",
        )
        index, name = model.float_param

        def param_in_the_padding(x, args, out):
            # A float parameter right after the scales' view (word (P - 1) * align(M, 4) + M): outside
            # the view, inside the padding rows the kernel writes.
            view_words = (shape[1] - 1) * strides[1] + m
            good = args[index]
            shared = torch.empty(words + good.numel(), dtype=torch.int32)
            param = shared[view_words : view_words + good.numel()].view(torch.float32).view(good.shape)
            args = [*args[:index], param, *args[index + 1 :]]
            return x, args, [*out[:-1], shared[:words].as_strided(shape, strides)]

        cases[f"padding rows over {name}"] = (
            param_in_the_padding,
            ValueError,
            f"{scales}: expected memory of its own, got a tensor overlapping {name}",
        )
    return cases


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_out_is_refused_before_any_launch(model: Fp8Model, fmt: str) -> None:
    op, kernels = model.fp8_op(2, fmt, False)
    m = TOKENS[0]
    for case, (change, error, message) in bad_calls(model, fmt, m).items():
        x, args, out = change(random((m, HIDDEN), torch.bfloat16), model.params(m, random), good_out(model, fmt, m))
        with pytest.raises(error, match=message):
            op(x, *args, out=out)
        if case != "q inside x":  # a plan's collect comes after its publish has copied x
            with pytest.raises(error, match=message):
                op.plan("call", x, *args, out=out)
        assert kernels.calls == [], f"{case}: a kernel was launched"
    op(random((m, HIDDEN), torch.bfloat16), *model.params(m, random))  # still usable
    assert kernels.names() == ["publish", model.collective_for(m), *model.after_collective]


def test_bf16_ops_keep_their_outputs(model: Fp8Model) -> None:
    """The default option's programs are the BF16 op's: contiguous outputs, no storage rule."""
    op, kernels = model.fp8_op(1, "bf16", False)
    x = random((3, HIDDEN), torch.bfloat16)
    *_, layer_input = op(x, *model.params(3, random))
    assert layer_input.dtype == torch.bfloat16 and layer_input.shape == (3, HIDDEN)
    assert "layer_input_q" not in kernels.calls[-1 - len(model.after_collective)][1]
    names = [f"out[{i}] ({name})" for i, name in enumerate((*model.first_outputs, "layer_input"))]
    assert not op._programs.call.sized_outputs and [r.name for r in op._programs.call.outputs] == names


# ------------------------------------------------------------------ the custom ops
def fake_inputs(model: Fp8Model, mode, m: int) -> tuple[list, list[Any]]:
    """``[state, x, gemm2, weights, index]`` and the parameters, fake CUDA tensors of M tokens."""
    with mode:
        inputs = [
            torch.empty(4, dtype=torch.int32, device="cuda"),
            torch.empty(m, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            torch.empty(2 * m, HIDDEN, dtype=torch.bfloat16, device="cuda"),
            torch.empty(m, TOP_K, device="cuda"), torch.empty(m, TOP_K, dtype=torch.int32, device="cuda"),
        ]  # fmt: skip
        params = model.params(m, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="cuda"))
    return inputs, params


@pytest.mark.parametrize("dynamic", (False, True), ids=("static", "dynamic"))
@pytest.mark.parametrize("both", (False, True), ids=("fp8", "fp8+bf16"))
@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_outputs_are_the_formats(model: Fp8Model, fmt: str, both: bool, dynamic: bool) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = model.module("library").OPS

    def layer(state, x, gemm2, weights, index, *params):
        rest = params[1:]
        first = ops.plain.fp8(state, 3, x, *params, fmt, both)
        second = ops.moe.fp8(state, 3, gemm2, weights, index, x, first[0], *rest, fmt, both)
        torch.ops.mhc.publish(state, 3, x)
        third = ops.collect_form.fp8(state, 3, second[0], *rest, fmt, both)
        return first, second, third

    for m in TOKENS:
        mode = FakeTensorMode()
        inputs, params = fake_inputs(model, mode, m)
        with mode:
            results, calls = traced(layer, *inputs, *params, dynamic=dynamic)
        assert calls == [ops.plain.fp8.name, ops.moe.fp8.name, "publish", ops.collect_form.fp8.name]
        specs = expected_outputs(model, fmt, both, m)
        specs = [specs[0], *specs[len(model.first_outputs) :]]  # the side outputs stay with the op
        if not both:  # the custom ops return four outputs, the last empty (LayerInput.op_outputs)
            specs = [*specs, (torch.bfloat16, (0,), (1,), None)]
        for outputs in results:
            assert len(outputs) == len(specs)
            for tensor, (dtype, shape, strides, _) in zip(outputs, specs, strict=True):
                assert (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) == (dtype, shape, strides)
                assert tensor.device.type == "cuda"


def test_the_wrappers_pick_the_ops_by_the_ops_format(model: Fp8Model) -> None:
    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from mhc_core.host.calls.layer_input import LayerInput

    library = model.module("library")
    mode = FakeTensorMode()
    (state, x, *_), params = fake_inputs(model, mode, 5)
    for fmt, both, count in (("bf16", False, 2), ("mx-g32", False, 3), ("fp32-g128", True, 4)):
        op = SimpleNamespace(state=state, handle=9, norm_eps=1e-6, layer_input=LayerInput(fmt, both))

        def layer(state, x, *params, op=op):
            outputs = library.boundary(op, x, *params)
            torch.ops.mhc.publish(state, 9, x)
            return outputs, library.collect(op, outputs[0], *params[1:])

        with mode:
            (called, collected), calls = traced(layer, state, x, *params)
        suffix = "_fp8" if fmt != "bf16" else ""
        assert calls == [f"{model.prefix}_boundary{suffix}", "publish", f"{model.prefix}_collect{suffix}"]
        assert isinstance(called, tuple) and len(called) == len(collected) == count


def test_the_real_op_refuses_another_format(model: Fp8Model) -> None:
    """The fake derives the outputs from the arguments: the real op checks they are its own."""
    from mhc_core.host import library as core_library

    implementation = model.module("library").OPS.plain.fp8.implementation
    op, kernels = model.fp8_op(1, "mx-g32", False)
    handle = core_library.register(op)
    try:
        args = (random((3, HIDDEN), torch.bfloat16), *model.params(3, random))
        with pytest.raises(ValueError, match=r"layer_input_format: the op behind handle \d+ writes 'mx-g32'"):
            implementation(op.state, handle, *args, "fp32-g128", False)
        assert kernels.calls == []
        outputs = implementation(op.state, handle, *args, "mx-g32", False)
        assert isinstance(outputs, tuple) and len(outputs) == 4 and outputs[1].dtype == F8
        assert outputs[3].numel() == 0  # the BF16 layer input not kept: an empty fourth output
    finally:
        core_library.unregister(handle)


class Fp8OpCases:
    """Every test above; a model's test class derives from it and gives the ``model`` fixture."""

    @pytest.fixture
    def no_build(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import mhc_core.host.op

        def started(device):
            raise BuildStarted(str(device))

        monkeypatch.setattr(mhc_core.host.op, "device_arch", started)


for _name, _test in list(globals().items()):
    if _name.startswith("test_"):
        setattr(Fp8OpCases, _name, staticmethod(_test))
