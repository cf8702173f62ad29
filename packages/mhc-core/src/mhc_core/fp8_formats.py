"""The layer input's formats, declared once (issue #33; issue #50): pure Python, no torch at import.

The option ``layer_input_format`` is ``"bf16"`` or one of the FP8 E4M3 formats below (``FORMATS``:
group, scale encoding and layout; ``mhc_core.fp8`` has the rounding, the layouts' formulas and the
torch references). The model packages' preset modules, kernel configs and ops all read this table;
the code generator imports those configs without torch, hence this module.

* ``require_layer_input``: the option's rules every model shares (the name, the BF16 copy, hidden a
  multiple of the group), raised as ``mhc_core.presets.PresetError`` naming the field; a model adds
  its own placement rules after it. A preset applies them where the value enters (its
  ``__post_init__``: a plain constructor and ``from_config`` build one too).
* ``LayerInputConfig``: what a kernel config derives from its two fields (``quantizes``,
  ``scale_layout``, ...) and its repr, a mixin of both models' configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .presets import require, require_type

if TYPE_CHECKING:
    import torch

ScaleEncoding = Literal["fp32", "ue8m0"]
ScaleLayout = Literal["row-major", "mn-major-packed", "swizzled-128x4"]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


@dataclass(frozen=True)
class Fp8Format:
    """One layer-input FP8 format: E4M3 values ``[M, H]`` plus one scale per ``group`` elements of a row.

    ``scale_encoding``: ``"fp32"`` (the scale itself) or ``"ue8m0"`` (a power of two, rounded up,
    stored as its biased exponent byte). ``layout``: where the scale of (row, group) lives; see
    ``mhc_core.fp8``'s docstring for each formula, and :meth:`scale_offset` for it as code.
    """

    name: str
    group: int
    scale_encoding: ScaleEncoding
    layout: ScaleLayout
    #: Who reads it (documentation).
    consumers: str

    # ------------------------------------------------------------------ shapes
    def groups(self, hidden: int) -> int:
        """Scales per row, ``H / group``; ``hidden`` must be a multiple of the group."""
        if hidden <= 0 or hidden % self.group:
            raise ValueError(f"{self.name}: hidden {hidden} is not a positive multiple of the group {self.group}")
        return hidden // self.group

    @property
    def scale_dtype(self) -> torch.dtype:
        import torch  # the table itself is torch-free

        return {"row-major": torch.float32, "mn-major-packed": torch.int32, "swizzled-128x4": torch.uint8}[self.layout]

    def scale_shape(self, m: int, hidden: int) -> tuple[int, ...]:
        """Logical shape of the scale tensor ``mhc_core.fp8.quantize`` returns."""
        g = self.groups(hidden)
        if self.layout == "row-major":
            return (m, g)
        if self.layout == "mn-major-packed":
            return (m, _ceil_div(g, 4))
        return (_align(m, 128) * _align(g, 4),)

    def scale_strides(self, m: int, hidden: int) -> tuple[int, ...]:
        """Strides (in elements of :attr:`scale_dtype`) of the scale tensor."""
        g = self.groups(hidden)
        if self.layout == "row-major":
            return (g, 1)
        if self.layout == "mn-major-packed":
            return (1, _align(m, 4))
        return (1,)

    def scale_storage_numel(self, m: int, hidden: int) -> int:
        """Elements of :attr:`scale_dtype` in the allocation, padding included."""
        g = self.groups(hidden)
        if self.layout == "row-major":
            return m * g
        if self.layout == "mn-major-packed":
            return _align(m, 4) * _ceil_div(g, 4)
        return _align(m, 128) * _align(g, 4)

    def scale_storage_bytes(self, m: int, hidden: int) -> int:
        return self.scale_storage_numel(m, hidden) * self.scale_dtype.itemsize

    def scale_offset(self, row: int, group: int, m: int, hidden: int) -> int:
        """Byte offset, in the allocation, of the scale of (``row``, ``group``): 4 bytes (FP32) or 1 (UE8M0)."""
        g = self.groups(hidden)
        if not (0 <= row < m and 0 <= group < g):
            raise IndexError(f"{self.name}: (row {row}, group {group}) outside [{m}, {g}]")
        if self.layout == "row-major":
            return 4 * (row * g + group)
        if self.layout == "mn-major-packed":
            return 4 * ((group // 4) * _align(m, 4) + row) + group % 4
        col_blocks = _ceil_div(g, 4)
        return ((row // 128) * col_blocks + group // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + group % 4

    def empty_scales(self, m: int, hidden: int, device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed scale tensor of this format's shape, strides and allocation (padding included)."""
        import torch

        storage = torch.zeros(self.scale_storage_numel(m, hidden), dtype=self.scale_dtype, device=device)
        return storage.as_strided(self.scale_shape(m, hidden), self.scale_strides(m, hidden))


FP32_G128 = Fp8Format(
    "fp32-g128",
    128,
    "fp32",
    "row-major",
    "vLLM/SGLang Triton w8a8 block-FP8 GEMMs (per_token_group_quant_fp8, row-major scales); "
    "DeepGEMM SM90 / CUTLASS block FP8 after an MN-major transpose",
)
UE8M0_G128_PACKED = Fp8Format(
    "ue8m0-g128-packed",
    128,
    "ue8m0",
    "mn-major-packed",
    "DeepGEMM SM100 FP8 GEMMs (fp8_gemm_nt, recipe (1, 1, 128), packed int SFA)",
)
MX_G32 = Fp8Format(
    "mx-g32",
    32,
    "ue8m0",
    "swizzled-128x4",
    "block-scaled MX FP8 GEMMs: cuBLASLt VEC32_UE8M0, CUTLASS sm100 mxf8f6f4, FlashInfer mm_mxfp8",
)
#: The FP8 formats by name.
FORMATS: dict[str, Fp8Format] = {f.name: f for f in (FP32_G128, UE8M0_G128_PACKED, MX_G32)}

#: The BF16 layer input (no quantisation), and every value ``layer_input_format`` takes.
BF16 = "bf16"
LAYER_INPUT_FORMATS = (BF16, *FORMATS)
#: The kernel config fields that choose it; left out of a BF16 config's repr, from which the
#: kernel's symbol name is built (so the BF16 kernels' PTX is what it was before they existed).
LAYER_INPUT_FIELDS = ("layer_input_format", "layer_input_bf16")


def get_format(name: str) -> Fp8Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 layer-input format {name!r}: expected one of {sorted(FORMATS)}") from None


def layer_input_group(layer_input_format: str) -> int:
    """Columns per scale of an FP8 format; 0 for BF16."""
    return 0 if layer_input_format == BF16 else FORMATS[layer_input_format].group


def require_layer_input(layer_input_format: object, layer_input_bf16: object, hidden: int) -> int:
    """The option's rules every model shares, each a ``PresetError`` (a ``TypeError`` one for a wrong
    type) naming the field; the format's group (0 for BF16). ``hidden`` must be checked already."""
    choices = ", ".join(LAYER_INPUT_FORMATS)
    require_type(isinstance(layer_input_format, str), "layer_input_format", f"expected a str, one of {choices}",
                 layer_input_format)  # fmt: skip
    require(layer_input_format in LAYER_INPUT_FORMATS, "layer_input_format", f"expected one of {choices}",
            layer_input_format)  # fmt: skip
    require_type(isinstance(layer_input_bf16, bool), "layer_input_bf16", "expected a bool (True or False)",
                 layer_input_bf16)  # fmt: skip
    if layer_input_format == BF16:
        rule = (
            "asks for the BF16 layer input beside an FP8 one; with layer_input_format "
            f"{BF16!r} it is the only one (expected False)"
        )
        require(not layer_input_bf16, "layer_input_bf16", rule, layer_input_bf16)
        return 0
    group = layer_input_group(str(layer_input_format))
    rule = f"{layer_input_format!r} has one scale per {group} columns, so hidden must be a multiple of {group} " \
        f"(hidden = {hidden})"  # fmt: skip
    require(hidden % group == 0, "layer_input_format", rule, layer_input_format)
    return group


class LayerInputConfig:
    """A kernel config's layer-input fields, ``layer_input_format`` and ``layer_input_bf16``: what the
    kernels derive from them, and the config's repr (a mixin of frozen, slotted dataclasses declared
    with ``repr=False``)."""

    __slots__ = ()
    hidden: int
    layer_input_format: str
    layer_input_bf16: bool

    def __repr__(self) -> str:
        # The kernel's symbol name is built from this text: a BF16 config reads as it did before the
        # layer-input fields existed, so the BF16 kernels' PTX is unchanged.
        fields: Any = self.__dataclass_fields__  # type: ignore[attr-defined]
        quantizes = self.quantizes
        shown = [f"{name}={getattr(self, name)!r}" for name in fields if name not in LAYER_INPUT_FIELDS or quantizes]
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def quantizes(self) -> bool:
        """Whether the layer input is FP8 (with its scales)."""
        return self.layer_input_format != BF16

    @property
    def stores_bf16_layer_input(self) -> bool:
        return not self.quantizes or self.layer_input_bf16

    @property
    def fp8_group(self) -> int:
        """Columns per scale (FP8 formats only)."""
        return FORMATS[self.layer_input_format].group

    @property
    def scale_layout(self) -> str:
        """Where each scale goes (``Fp8Format.layout``; FP8 formats only)."""
        return FORMATS[self.layer_input_format].layout

    @property
    def scale_groups(self) -> int:
        """Scales per token, ``hidden / group`` (FP8 formats only)."""
        return self.hidden // self.fp8_group
