"""Python literals written the way ``ruff format`` writes them, so generated modules need no formatter.

The rule ruff (and black) apply to collection literals: a collection stays on one
line when the line fits, without a trailing comma; otherwise it is split one item
per line, each followed by a comma (the "magic trailing comma" then keeps it split).
Strings take double quotes; floats their shortest round-trip ``repr``.
"""

from __future__ import annotations

import ast
import math
from typing import Any

LINE_LENGTH = 120
INDENT = 4

_BRACKETS = {tuple: ("(", ")"), list: ("[", "]"), dict: ("{", "}")}


def scalar(value: Any) -> str:
    """One scalar: None, bool, int, finite float or str."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"no literal for the float {value!r}")
        return repr(value)
    if isinstance(value, str):
        text = repr(value)
        if text.startswith("'") and '"' not in value:
            text = '"' + text[1:-1].replace("\\'", "'") + '"'
        return text
    raise TypeError(f"no literal for {type(value).__name__} {value!r}")


def _items(value: tuple | list | dict) -> list[tuple[str, Any]]:
    """(prefix, item) pairs: ``"key": `` and the value for dicts, no prefix for sequences."""
    if isinstance(value, dict):
        return [(f"{scalar(key)}: ", item) for key, item in value.items()]
    return [("", item) for item in value]


def one_line(value: Any) -> str:
    kind = type(value)
    if kind not in _BRACKETS:
        return scalar(value)
    opening, closing = _BRACKETS[kind]
    body = ", ".join(prefix + one_line(item) for prefix, item in _items(value))
    if kind is tuple and len(value) == 1:
        body += ","
    return opening + body + closing


def literal(value: Any, *, indent: int = 0, used: int = 0, trailing: int = 0, split: bool = False) -> str:
    """``value`` as a literal starting ``used`` columns into a line indented by ``indent``.

    ``trailing`` counts the characters that follow it on its last line (a comma).
    ``split=True`` splits a non-empty collection even where it would fit.
    """
    kind = type(value)
    text = one_line(value)
    if kind not in _BRACKETS or not value or (not split and used + len(text) + trailing <= LINE_LENGTH):
        return text
    opening, closing = _BRACKETS[kind]
    inner = indent + INDENT
    lines = [opening]
    for prefix, item in _items(value):
        body = literal(item, indent=inner, used=inner + len(prefix), trailing=1)
        lines.append(" " * inner + prefix + body + ",")
    lines.append(" " * indent + closing)
    return "\n".join(lines)


def checked(value: Any, **options: Any) -> str:
    """``literal(value, ...)``, verified to evaluate back to ``value``."""
    text = literal(value, **options)
    if ast.literal_eval(text) != value:
        raise AssertionError(f"literal {text!r} does not evaluate to {value!r}")
    return text
