"""One model's tables out of the repository's root presets.toml, comments kept: what a model
package's sdist carries as its ``presets.toml`` (its ``hatch_build.py`` loads this file by path, so it
needs the standard library only), from which ``python3 -m codegen --presets`` renders its modules again.

A table's block is its ``[<key>.<name>]`` header with the comment lines right above it (no blank
line between) and its lines up to its last key; the notes the models' tables share stay in the root
file.
"""

from __future__ import annotations

import re
import tomllib

HEADER = re.compile(r"\[\s*\"?([A-Za-z0-9_]+)\"?\s*\.")


def _is_key_line(line: str) -> bool:
    stripped = line.strip()
    return stripped != "" and not stripped.startswith("#")


def _blocks(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(model key, lines) per table: its header, the comment lines right above it, and its lines up to
    its last key line (comments after it belong to what follows)."""
    headers = [index for index, line in enumerate(lines) if HEADER.match(line)]
    blocks = []
    for number, index in enumerate(headers):
        start = index
        while start > 0 and lines[start - 1].startswith("#"):
            start -= 1
        limit = headers[number + 1] if number + 1 < len(headers) else len(lines)
        end = max(i for i in range(index, limit) if _is_key_line(lines[i])) + 1
        match = HEADER.match(lines[index])
        assert match is not None
        blocks.append((match.group(1), lines[start:end]))
    return blocks


def model_tables(text: str, key: str, origin: str = "presets.toml") -> str:
    """The ``[<key>.*]`` tables of the presets file ``text``, as a file of their own (a header naming
    ``origin`` first); ValueError if the result does not hold exactly those tables."""
    lines = text.splitlines(keepends=True)
    blocks = ["".join(block) for model, block in _blocks(lines) if model == key]
    extracted = (
        f"# The [{key}.<name>] tables of the repository's {origin}, copied when this sdist was built.\n"
        f"# In a checkout, `python3 -m codegen --presets presets.toml` renders them again.\n\n"
    ) + "\n".join(blocks)
    wanted = tomllib.loads(text).get(key)
    if wanted is None or tomllib.loads(extracted) != {key: wanted}:
        raise ValueError(f"{origin}: the [{key}.*] tables could not be copied out whole")
    return extracted
