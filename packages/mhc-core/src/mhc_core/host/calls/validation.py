"""Argument checks run before any launch; every message names the argument, expected and actual."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...presets import FP32_MAX, FP32_MIN_NORMAL

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int32: "int32", torch.int64: "int64"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(extent) for extent in shape) + "]"


#: The largest value of an Int32 kernel parameter.
INT32_MAX = 2**31 - 1


def _allowed(minimum: int | None, maximum: int | None) -> str:
    """`` (allowed: [minimum, maximum])`` when both bounds exist: the message then names the range."""
    return f" (allowed: [{minimum}, {maximum}])" if minimum is not None and maximum is not None else ""


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    allowed = _allowed(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}{allowed}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected >= {minimum}, got {value}{allowed}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected <= {maximum}, got {value}{allowed}")
    return value


def check_positive_float(name: str, value: object) -> float:
    """A float the kernels compute with in FP32: finite, > 0 and a normal FP32 value (nan, inf,
    negatives, zero and values that round to zero or inf in FP32 are refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not FP32_MIN_NORMAL <= value <= FP32_MAX:  # nan compares false
        raise ValueError(
            f"{name}: expected a finite value > 0, got {value} (allowed: FP32's normal range "
            f"[{FP32_MIN_NORMAL:.9g}, {FP32_MAX:.9g}], which the kernels compute in)"
        )
    return float(value)


def check_tensor(
    name: str,
    tensor: object,
    *,
    shape: Sequence[int] | Sequence[Sequence[int]],
    dtype: torch.dtype | Sequence[torch.dtype],
    device: torch.device,
    align: int = 16,
    strides: Sequence[int] | None = None,
) -> torch.Tensor:
    """A contiguous tensor (or one of the given ``strides``) of one of the given shapes and dtypes on
    ``device``, its first element aligned to ``align`` bytes (every kernel moves 16-byte fragments
    or reads scalars at their natural alignment)."""
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
    if strides is not None:
        # As torch's contiguity: a dimension of extent 1 may have any stride.
        actual = tuple(tensor.stride())
        if any(extent != 1 and got != want for extent, got, want in zip(tensor.shape, actual, strides, strict=True)):
            raise ValueError(f"{name}: expected strides {tuple(strides)}, got {actual}")
    elif not tensor.is_contiguous():
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
