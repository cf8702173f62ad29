"""Kernel parameters in groups: the base of the bundles a kernel's entry takes and hands on.

A ``@cute.kernel`` takes a frozen dataclass as one parameter and the DSL lays its fields out as the
kernel's parameters, in field order: the same PTX parameters as the separate values. The DSL also
names the kernel after its parameters' ``str``, so a bundle names itself as its fields would one by
one (``_``-joined); the entry's name, and so the whole PTX, stays what the separate parameters gave
(``tools.compile_presets --ptx-digest``). Frozen, as ``mhc_core.device.protocol``'s bundles: reading
a field emits nothing, and the DSL passes it into a dynamic region read-only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class KernelBundle:
    """Subclass with ``@dataclass(frozen=True)``; the fields are the kernel's parameters, in order."""

    def __str__(self) -> str:
        return "_".join(str(getattr(self, field.name)) for field in fields(self))


def values(bundle: KernelBundle) -> tuple:
    """The fields' values in order (``dataclasses.astuple`` would copy them)."""
    return tuple(getattr(bundle, field.name) for field in fields(bundle))
