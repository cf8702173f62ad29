"""Reading compiled PTX in tests: instructions, loops, registers."""

from __future__ import annotations

import re

_LABEL = re.compile(r"^\s*(\$L__\w+):")
_BRANCH = re.compile(r"bra(?:\.uni)?\s+(\$L__\w+);")


def instructions(ptx: str) -> list[str]:
    """Instruction lines, comments and blank lines dropped."""
    lines = []
    for line in ptx.splitlines():
        line = line.split("//")[0].strip()
        if line:
            lines.append(line)
    return lines


def loop_bodies(ptx: str) -> list[list[str]]:
    """The lines of every loop: from a label to a later branch back to it."""
    lines = instructions(ptx)
    labels = {}
    bodies = []
    for index, line in enumerate(lines):
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = index
        branch = _BRANCH.search(line)
        if branch and branch.group(1) in labels:
            bodies.append(lines[labels[branch.group(1)] : index + 1])
    return bodies


_RUNTIME_DIVISION = re.compile(r"\b(?:div|rem)\.[su](?:32|64)\s+%\w+,\s*%\w+,\s*%\w+;")


def runtime_divisions(ptx: str) -> int:
    """Integer divisions and remainders by a register (by a constant, ptxas multiplies instead)."""
    return sum(bool(_RUNTIME_DIVISION.search(line)) for line in instructions(ptx))


def count(ptx: str, needle: str) -> int:
    return sum(needle in line for line in instructions(ptx))


def has_local_memory(ptx: str) -> bool:
    return any(".local" in line for line in instructions(ptx))


def polls_volatile_in_loop(ptx: str) -> bool:
    return any(any("ld.volatile.global.v4.u32" in line for line in body) for body in loop_bodies(ptx))
