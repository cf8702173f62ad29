"""The BF16 -0 bit tricks on all 65536 patterns, through an integer mirror of ``mhc_core.device.ptx``.

The mirror uses the primitives' own constants and the same expression; the GPU
suite runs the compiled code itself over the same patterns.
"""

from __future__ import annotations

import numpy as np
import pytest


def marks(words: np.ndarray) -> np.ndarray:
    from mhc_core.constants import MAGNITUDE_BF16_PAIR
    from mhc_core.device.ptx import SIGN_BF16_PAIR

    flipped = words ^ np.uint32(SIGN_BF16_PAIR)
    return ((flipped & np.uint32(MAGNITUDE_BF16_PAIR)) + np.uint32(MAGNITUDE_BF16_PAIR)) | flipped


def has_negative_zero(words: np.ndarray) -> np.ndarray:
    from mhc_core.device.ptx import SIGN_BF16_PAIR

    return ((marks(words) ^ np.uint32(SIGN_BF16_PAIR)) & np.uint32(SIGN_BF16_PAIR)) != 0


def sanitize(words: np.ndarray) -> np.ndarray:
    from mhc_core.constants import MAGNITUDE_BF16_PAIR

    return words & (marks(words) | np.uint32(MAGNITUDE_BF16_PAIR))


PATTERNS = np.arange(65536, dtype=np.uint32)


@pytest.mark.parametrize("high", (False, True), ids=("low half", "high half"))
@pytest.mark.parametrize("other", (0x0000, 0x3F80, 0x8001, 0xFFFF))
def test_every_pattern_in_either_half(high: bool, other: int) -> None:
    words = (PATTERNS << 16) | other if high else (np.uint32(other) << 16) | PATTERNS
    detected = has_negative_zero(words)
    assert np.array_equal(detected, PATTERNS == 0x8000)
    cleaned = sanitize(words)
    expected_half = np.where(PATTERNS == 0x8000, 0, PATTERNS).astype(np.uint32)
    expected = (expected_half << 16) | other if high else (np.uint32(other) << 16) | expected_half
    assert np.array_equal(cleaned, expected)


def test_both_halves_negative_zero() -> None:
    from mhc_core.constants import NEGATIVE_ZERO_BF16_PAIR

    word = np.array([NEGATIVE_ZERO_BF16_PAIR], dtype=np.uint32)
    assert has_negative_zero(word).all()
    assert sanitize(word)[0] == 0


def test_fp32_negative_zero() -> None:
    """The same expression on FP32 words (the hand-off rows): only 0x80000000 is -0; sanitising
    changes it alone. Every pattern of the high half with four low halves, plus random words."""
    from mhc_core.constants import NEGATIVE_ZERO_F32
    from mhc_core.device.ptx import MAGNITUDE_F32, SIGN_F32

    def f32_marks(words: np.ndarray) -> np.ndarray:
        flipped = words ^ np.uint32(SIGN_F32)
        return ((flipped & np.uint32(MAGNITUDE_F32)) + np.uint32(MAGNITUDE_F32)) | flipped

    generator = np.random.default_rng(0)
    words = np.concatenate(
        [(PATTERNS << 16) | low for low in (0x0000, 0x0001, 0x8000, 0xFFFF)]
        + [generator.integers(0, 2**32, 1 << 20, dtype=np.uint32)]
    ).astype(np.uint32)
    is_negative_zero = words == NEGATIVE_ZERO_F32
    assert is_negative_zero.sum() == 1
    detected = ((f32_marks(words) ^ np.uint32(SIGN_F32)) & np.uint32(SIGN_F32)) != 0
    assert np.array_equal(detected, is_negative_zero)
    cleaned = words & (f32_marks(words) | np.uint32(MAGNITUDE_F32))
    assert np.array_equal(cleaned, np.where(is_negative_zero, np.uint32(0), words))
