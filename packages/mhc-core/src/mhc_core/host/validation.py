"""Argument checks run before any launch; every message names the argument, expected and actual."""

from __future__ import annotations

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
