"""The per-call parameters of a fused op, declared once: checked in C++ on every call (the native
executor, ``mhc_core.host.binaries.native``), and here, in Python, for the message when a call fails.

A parameter is a ``TensorRule`` (accepted dtypes and shapes; a shape names the token count ``M``
and the MoE expert output's ``ROWS`` where they vary, ``Aligned`` where it follows one padded to a
multiple) or a ``ScalarRule`` (a finite float > 0).
The first tensor whose leading extent is ``M`` binds it (and must hold ``1 <= M <=
max_num_tokens``); every later ``M`` must equal it. Outputs are ``TensorRule``s too: allocated
from their first shape and dtype, or, when the caller passes them, checked like the inputs. A
given output may be one of the parameters its rule names in ``aliases`` (exactly those bytes, in
place: issue #32) and overlaps nothing else. An output may also give its ``strides`` (a layout
torch calls non-contiguous: the FP8 scales MN-major) and its ``storage``, the elements the kernel
writes from its first one when they run past the view (the scale layouts' padding rows): what the
overlap checks span, and what the caller's ``out=`` tensor's storage must hold (``check_storage``).

``check_call`` runs the rules in order and raises the first failure with the argument's name,
what was expected and what came (``mhc_core.host.calls.validation``'s messages).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .validation import check_positive_float, check_tensor, check_token_count, leading_extent

#: What a layer-input output may be in place: the publish input (x, or the MoE shared output).
IN_PLACE_LAYER_INPUT = ("x", "shared_output")
#: Shape entries that vary per call.
M = "M"
ROWS = "rows"


@dataclass(frozen=True)
class Aligned:
    """``align(M, to) * times`` (or of the MoE rows, ``base=ROWS``): an extent, stride or storage
    size that follows the token count padded to a multiple, as the FP8 scale layouts pad rows."""

    base: str = M
    to: int = 1
    times: int = 1

    def resolve(self, m: int, rows: int) -> int:
        count = m if self.base == M else rows
        return (count + self.to - 1) // self.to * self.to * self.times


Dim = int | str | Aligned


@dataclass(frozen=True)
class TensorRule:
    """A tensor parameter: one of ``dtypes``, one of ``shapes``, contiguous, on the op's device,
    its data pointer aligned to ``align`` bytes (0: its element size)."""

    name: str
    shapes: tuple[tuple[Dim, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    align: int = 16
    #: An output's: the parameters it may be exactly (in place); it overlaps nothing else.
    aliases: tuple[str, ...] = ()
    #: An output's strides (None: contiguous as torch defines it).
    strides: tuple[Dim, ...] | None = None
    #: An output's elements the kernel writes from its first, when more than its view spans.
    storage: Dim | None = None

    @property
    def binds_m(self) -> bool:
        return bool(self.shapes[0]) and self.shapes[0][0] == M

    @property
    def binds_rows(self) -> bool:
        return bool(self.shapes[0]) and self.shapes[0][0] == ROWS


@dataclass(frozen=True)
class ScalarRule:
    """A float parameter: finite and > 0 (an int is taken as a float)."""

    name: str


Rule = TensorRule | ScalarRule


def tensor(
    name: str,
    *shapes: tuple[Dim, ...],
    dtype: torch.dtype | Sequence[torch.dtype],
    align: int = 16,
    aliases: tuple[str, ...] = (),
    strides: tuple[Dim, ...] | None = None,
    storage: Dim | None = None,
) -> TensorRule:
    """A ``TensorRule`` with one or more accepted shapes."""
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    return TensorRule(name, tuple(shapes), dtypes, align, aliases, strides, storage)


def resolve(dim: Dim, m: int, rows: int) -> int:
    if isinstance(dim, Aligned):
        return dim.resolve(m, rows)
    return m if dim == M else rows if dim == ROWS else int(dim)


def _resolved(shape: tuple[Dim, ...], m: int, rows: int) -> tuple[int, ...]:
    return tuple(resolve(dim, m, rows) for dim in shape)


def check_call(
    rules: Sequence[Rule],
    values: Sequence[object],
    *,
    capacity: int,
    device: torch.device,
    m: int | None = None,
    outputs: Sequence[TensorRule] = (),
    out: Sequence[object] | None = None,
) -> int:
    """Check ``values`` against ``rules`` (and ``out`` against ``outputs``); the token count M.
    ``m``: the pending publish's M (a collect), which the parameters must match."""
    rows = -1
    for rule, value in zip(rules, values, strict=True):
        if isinstance(rule, ScalarRule):
            check_positive_float(rule.name, value)
            continue
        if rule.binds_m and m is None:
            m = check_token_count(rule.name, leading_extent(rule.name, value), capacity)
        if rule.binds_rows:
            rows = leading_extent(rule.name, value)
        shapes = [_resolved(shape, m if m is not None else -1, rows) for shape in rule.shapes]
        check_tensor(rule.name, value, shape=shapes, dtype=rule.dtypes, device=device, align=_align(rule, value))
    if m is None:
        raise TypeError("no parameter gives the token count M")
    for rule, value in zip(outputs, out or (), strict=False):
        strides = None if rule.strides is None else _resolved(rule.strides, m, rows)
        shape = _resolved(rule.shapes[0], m, rows)
        check_tensor(rule.name, value, shape=shape, dtype=rule.dtypes, device=device, strides=strides)
    if out is not None:
        check_overlaps(rules, values, outputs, out, m=m, rows=rows)
        for rule, value in zip(outputs, out, strict=False):
            check_storage(rule, value)
    return m


def _span(value: object, rule: TensorRule | None = None, m: int = -1, rows: int = -1) -> tuple[int, int]:
    """The bytes a checked tensor spans: its view (contiguous or with the rule's strides), or the
    rule's ``storage`` from its first element."""
    assert isinstance(value, torch.Tensor)
    first = value.data_ptr()
    if rule is not None and rule.storage is not None:
        elements = resolve(rule.storage, m, rows)
    elif value.numel() == 0:
        elements = 0
    else:
        elements = 1 + sum((extent - 1) * stride for extent, stride in zip(value.shape, value.stride(), strict=True))
    return first, first + elements * value.element_size()


def check_storage(rule: TensorRule, value: object) -> None:
    """A given output with a ``storage`` rule: its storage holds that many elements from its first
    one (a view's own bounds do not: the kernel writes padding past them). M is taken from the
    tensor's leading extent (the shape checks hold it to the call's)."""
    if rule.storage is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return
    needed = resolve(rule.storage, int(value.shape[0]), -1)
    held = value.untyped_storage().nbytes() // value.element_size() - value.storage_offset()
    if held < needed:
        raise ValueError(
            f"{rule.name}: expected a storage of at least {needed} {str(value.dtype).replace('torch.', '')} "
            f"elements from its first (the layout's padding rows are written too), got {held}"
        )


def check_overlaps(
    rules: Sequence[Rule],
    values: Sequence[object],
    outputs: Sequence[TensorRule],
    out: Sequence[object],
    *,
    m: int = -1,
    rows: int = -1,
) -> None:
    """Each output overlaps no parameter but one its rule ``aliases``, and then exactly (in place),
    and no other output (the same rule as the native executor's)."""
    seen: list[tuple[str, tuple[int, int]]] = [
        (rule.name, _span(value)) for rule, value in zip(rules, values, strict=True) if isinstance(rule, TensorRule)
    ]
    for rule, value in zip(outputs, out, strict=False):
        mine = _span(value, rule, m, rows)
        if mine[0] == mine[1]:
            continue
        for name, theirs in seen:
            if not (mine[0] < theirs[1] and theirs[0] < mine[1]):
                continue
            if name in rule.aliases and mine == theirs:
                continue
            allowed = f"; it may only be {' or '.join(rule.aliases)} itself (in place)" if rule.aliases else ""
            raise ValueError(
                f"{rule.name}: expected memory of its own{allowed}, got a tensor overlapping {name} "
                f"(bytes [{mine[0]:#x}, {mine[1]:#x}) against [{theirs[0]:#x}, {theirs[1]:#x}))"
            )
        seen.append((rule.name, mine))


def _align(rule: TensorRule, value: object) -> int:
    if rule.align:
        return rule.align
    return value.element_size() if isinstance(value, torch.Tensor) else 4
