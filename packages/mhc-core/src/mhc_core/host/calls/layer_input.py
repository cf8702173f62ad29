"""The layer input's format, an op option (issue #33): BF16, or FP8 E4M3 with per-group scales in
one of ``mhc_core.fp8.FORMATS``, optionally with the BF16 copy beside it.

Both models follow one rule for what a call returns (and takes as ``out=``): the op's outputs up to
the layer input as they are, then

* ``"bf16"``: ``layer_input`` (BF16 ``[M, hidden]``), as before the option existed;
* an FP8 format: ``layer_input_q`` (``float8_e4m3fn [M, hidden]``) and ``layer_input_scales`` (the
  format's tensor, ``Fp8Format.empty_scales``' shape and strides over its whole allocation);
* an FP8 format with ``layer_input_bf16=True``: ``layer_input_q``, ``layer_input_scales``, then the
  BF16 ``layer_input``.

``LayerInput`` holds the option as the op's preset validated it (``mhc_core.fp8_formats``'
``require_layer_input``: before any compile or launch, errors naming the argument), declares those
outputs (``output_rules``: the native executor checks a given ``out=`` against them, and allocates
none: ``allocate`` does, as torch tensors, the fake implementations too) and names the kernel
parameters they feed (``sources``). Scale tensors are allocated uninitialised: the kernels write
every byte of them, padding included (poisoned: NaN codes and scales).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ... import fp8_formats as fp8
from ...fp8_formats import BF16, LAYER_INPUT_FORMATS, require_layer_input
from ...presets import argument_preset
from .programs import Pointer
from .rules import IN_PLACE_LAYER_INPUT, Aligned, M, TensorRule, tensor

#: Every value the option takes (``BF16``, then the FP8 formats).
FORMATS = LAYER_INPUT_FORMATS
#: The outputs' names after ``out[i]`` (kernel parameters of the same names).
Q, SCALES, HIDDEN = "layer_input_q", "layer_input_scales", "layer_input"


def _align(count: Any, to: int) -> Any:
    """``count`` rounded up to a multiple of ``to`` (an int, or a symbolic size while tracing)."""
    return (count + to - 1) // to * to


@dataclass(frozen=True)
class LayerInput:
    """What an op writes as its layer input (module docstring): ``format`` and ``keep_bf16``."""

    format: str = BF16
    keep_bf16: bool = False

    @classmethod
    def checked(cls, layer_input_format: object, layer_input_bf16: object, hidden_size: int) -> LayerInput:
        """The option from arguments, or a TypeError / ValueError naming the argument: the rules of
        ``mhc_core.fp8_formats.require_layer_input`` (the ops apply them through their preset)."""
        argument_preset(require_layer_input, layer_input_format, layer_input_bf16, hidden_size)
        return cls(layer_input_format, layer_input_bf16)  # type: ignore[arg-type]

    @property
    def quantizes(self) -> bool:
        return self.format != BF16

    @property
    def fp8(self) -> fp8.Fp8Format:
        return fp8.get_format(self.format)

    @property
    def names(self) -> tuple[str, ...]:
        """The outputs in the order a call returns them (module docstring)."""
        if not self.quantizes:
            return (HIDDEN,)
        return (Q, SCALES, HIDDEN) if self.keep_bf16 else (Q, SCALES)

    def output_names(self, first: int) -> tuple[str, ...]:
        """The outputs' rule names, ``out[first] (...)`` on."""
        return tuple(f"out[{first + index}] ({name})" for index, name in enumerate(self.names))

    # ----------------------------------------------------------------- rules
    def output_rules(
        self, first: int, hidden: int, aliases: tuple[str, ...] = IN_PLACE_LAYER_INPUT
    ) -> tuple[TensorRule, ...]:
        """The outputs' rules, the first named ``out[first]``. The BF16 layer input may be one of
        ``aliases`` exactly (in place); ``q`` and the scales are memory of their own."""
        rules = []
        for name, label in zip(self.names, self.output_names(first), strict=True):
            if name == HIDDEN:
                rules.append(tensor(label, (M, hidden), dtype=torch.bfloat16, aliases=aliases))
            elif name == Q:
                rules.append(tensor(label, (M, hidden), dtype=torch.float8_e4m3fn))
            else:
                rules.append(self._scale_rule(label, hidden))
        return tuple(rules)

    def _scale_rule(self, label: str, hidden: int) -> TensorRule:
        layout, groups = self.fp8.layout, self.fp8.groups(hidden)
        if layout == "row-major":  # [M, G] contiguous
            return tensor(label, (M, groups), dtype=torch.float32)
        if layout == "mn-major-packed":  # [M, P] strides (1, align(M, 4)), P * align(M, 4) words written
            packs = -(-groups // 4)
            return tensor(
                label, (M, packs), dtype=torch.int32, strides=(1, Aligned(M, 4)), storage=Aligned(M, 4, packs)
            )
        # swizzled-128x4: flat bytes, 128-row tiles of 4-group blocks
        return tensor(label, (Aligned(M, 128, 4 * -(-groups // 4)),), dtype=torch.uint8)

    def sources(self, first: int) -> dict[str, Pointer]:
        """The kernel parameters the outputs feed, from ``out[first]``: ``layer_input`` (BF16, or, when
        only FP8 is written, ``q``'s address: the kernel stores nothing there) and, with FP8,
        ``layer_input_q`` and ``layer_input_scales``."""
        labels = dict(zip(self.names, self.output_names(first), strict=True))
        if not self.quantizes:
            return {HIDDEN: Pointer(labels[HIDDEN])}
        return {
            HIDDEN: Pointer(labels.get(HIDDEN, labels[Q])),
            Q: Pointer(labels[Q]),
            SCALES: Pointer(labels[SCALES]),
        }

    # ------------------------------------------------------------- allocation
    def allocate(self, like: torch.Tensor | None, base: torch.Tensor, m: Any, hidden: int) -> tuple[torch.Tensor, ...]:
        """New outputs for M tokens: the BF16 layer input ``empty_like(like)`` (the publish input, of
        its shape and dtype) or, with ``like`` None, new from ``base`` (any tensor on the op's device:
        the residual streams); ``q`` and the scales new from ``base``. Real and fake tensors alike (a
        fake implementation's M may be symbolic)."""
        writes_bf16 = self.keep_bf16 or not self.quantizes
        hidden_out = (self._bf16(like, base, m, hidden),) if writes_bf16 else ()
        if not self.quantizes:
            return hidden_out
        q = base.new_empty((m, hidden), dtype=torch.float8_e4m3fn)
        return (q, self.empty_scales(base, m, hidden), *hidden_out)

    def op_outputs(
        self, outputs: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A quantising call's outputs ``(residual_out, q, scales[, layer_input])`` as a custom op returns
        them: always four, the last an empty BF16 tensor when the BF16 layer input is not kept. A fixed
        tuple because the ops mutate their state: functionalization (torch.compile, opcheck) refuses a
        mutating custom op that returns a list."""
        if self.keep_bf16:
            return outputs  # type: ignore[return-value]
        residual_out, q, scales = outputs
        return residual_out, q, scales, residual_out.new_empty(0, dtype=torch.bfloat16)

    def call_outputs(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A custom op's four outputs back as the op's call returns them (``op_outputs`` undone)."""
        return tuple(outputs) if self.keep_bf16 else tuple(outputs[:3])

    @staticmethod
    def _bf16(like: torch.Tensor | None, base: torch.Tensor, m: Any, hidden: int) -> torch.Tensor:
        if like is not None:
            return torch.empty_like(like)
        return base.new_empty((m, hidden), dtype=torch.bfloat16)

    def empty_scales(self, base: torch.Tensor, m: Any, hidden: int) -> torch.Tensor:
        """An uninitialised scale tensor of ``Fp8Format.empty_scales``' shape, strides and allocation."""
        layout, groups = self.fp8.layout, self.fp8.groups(hidden)
        if layout == "row-major":
            return base.new_empty((m, groups), dtype=torch.float32)
        packs = -(-groups // 4)
        if layout == "mn-major-packed":
            rows = _align(m, 4)
            return base.new_empty((packs * rows,), dtype=torch.int32).as_strided((m, packs), (1, rows))
        return base.new_empty((_align(m, 128) * 4 * packs,), dtype=torch.uint8)


def preset_changes(preset: Any, options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """Pop from ``options`` (a model's ``from_config`` keywords) the preset fields ``names`` an op may
    override, as ``dataclasses.replace`` changes. ``layer_input_format`` given replaces both of the
    preset's layer-input fields (``layer_input_bf16`` False unless given too); a layer-input change
    is checked with the rest of the preset's fields, when the changed preset is built."""
    changes = {name: options.pop(name) for name in names if name in options}
    if "layer_input_format" in changes:
        changes.setdefault("layer_input_bf16", False)
    return changes
