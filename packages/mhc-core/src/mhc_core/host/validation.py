"""Argument checks run before any launch; every message names the argument, expected and actual."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int32: "int32", torch.int64: "int64"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(extent) for extent in shape) + "]"


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected <= {maximum}, got {value}")
    return value


def check_positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite value > 0, got {value}")
    return float(value)


def check_tensor(
    name: str,
    tensor: object,
    *,
    shape: Sequence[int] | Sequence[Sequence[int]],
    dtype: torch.dtype | Sequence[torch.dtype],
    device: torch.device,
    align: int = 16,
) -> torch.Tensor:
    """A contiguous tensor of one of the given shapes and dtypes on ``device``,
    its first element aligned to ``align`` bytes (every kernel moves 16-byte
    fragments or reads scalars at their natural alignment)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if tensor.dtype not in dtypes:
        expected = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {expected}, got {_dtype_name(tensor.dtype)}")
    shapes = [tuple(shape)] if not shape or isinstance(shape[0], int) else [tuple(s) for s in shape]
    if tuple(tensor.shape) not in shapes:
        expected = " or ".join(_shape(s) for s in shapes)
        raise ValueError(f"{name}: expected shape {expected}, got {_shape(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name}: expected device {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(tensor.stride())}")
    if tensor.data_ptr() % align:
        raise ValueError(f"{name}: expected a {align}-byte aligned data pointer, got address {tensor.data_ptr():#x}")
    return tensor


def check_token_count(name: str, m: int, capacity: int) -> int:
    if not 1 <= m <= capacity:
        raise ValueError(f"{name}: expected 1 <= M <= max_num_tokens = {capacity}, got M = {m}")
    return m


def leading_extent(name: str, tensor: object) -> int:
    """M from the first dimension of a tensor argument, with a clear error if it has none."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise ValueError(f"{name}: expected at least one dimension (M, ...), got a scalar")
    return int(tensor.shape[0])


#: Values that enter a key as themselves (the common non-tensor arguments: eps, None, names).
_PLAIN = frozenset({int, float, bool, str, type(None)})


def _argument_key(value: object) -> object:
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if isinstance(value, torch.Tensor):
        # Everything check_tensor reads: dtype, shape, device, contiguity and the pointer's
        # alignment (its low bits: every alignment checked is <= 16 bytes).
        return (value.dtype, value.shape, value.device, value.is_contiguous(), value.data_ptr() & 15)
    if isinstance(value, (tuple, list)):
        return (type(value), *map(_argument_key, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value), *(_argument_key(getattr(value, f.name)) for f in dataclasses.fields(value)))
    return (type(value), value)


def argument_key(*values: object) -> tuple[object, ...]:
    """A key of every property the argument checks read, for ``ValidatedCalls``. Never a data
    pointer alone: the allocator hands a freed tensor's address to the next tensor, which may
    have any shape or dtype. Scalars enter by type and value; tuples, lists and dataclasses
    (``MoEOutput``) by their items."""
    return tuple(map(_argument_key, values))


class ValidatedCalls:
    """The argument keys (``argument_key``) an op has validated completely: a call with a key seen
    before skips the checks, any other runs them all (and raises before any launch)."""

    #: Distinct keys kept; then the set starts over (an engine sees a few per batch size).
    LIMIT = 4096

    def __init__(self) -> None:
        self._keys: set[tuple[object, ...]] = set()

    def __contains__(self, key: tuple[object, ...]) -> bool:
        return key in self._keys

    def add(self, key: tuple[object, ...]) -> None:
        if len(self._keys) >= self.LIMIT:
            self._keys.clear()
        self._keys.add(key)
