"""Kernel signatures: described once, turned into compile-time fakes (and, on the host, arguments).

Every kernel class lists its ``@cute.jit __call__`` parameters as a tuple of
``Param``s. The compiler builds the fakes from it (no positional fake lists at
compile sites), and ``mhc_core.host.launch.BoundKernel`` converts persistent
buffers once and only the per-call values on each launch:

* ``Ptr``: a per-call tensor, passed as a bare aligned pointer (under a microsecond
  of host work, against several for a DLPack conversion). The op validates the
  tensor's shape, dtype, contiguity and alignment before any launch.
* ``Buffer``: a persistent 1-D tensor (mailbox, stage state, peer table), static or
  with a dynamic extent of known divisibility; converted once through DLPack.
* ``Scalar`` and ``Stream``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_ptr


@dataclass(frozen=True)
class Ptr:
    """A per-call tensor passed as a pointer to its first element."""

    dtype: type
    align: int = 16

    def fake(self) -> Any:
        return make_ptr(self.dtype, 0, cute.AddressSpace.gmem, assumed_align=self.align)


@dataclass(frozen=True)
class Buffer:
    """A persistent 1-D tensor: ``extent`` elements, or dynamic with ``divisibility``."""

    dtype: type
    extent: int | None = None
    divisibility: int = 1
    align: int = 16

    def fake(self) -> Any:
        extent = self.extent if self.extent is not None else cute.sym_int(divisibility=self.divisibility)
        return make_fake_compact_tensor(self.dtype, (extent,), assumed_align=self.align)


@dataclass(frozen=True)
class Scalar:
    dtype: type

    def fake(self) -> Any:
        return self.dtype(0)


@dataclass(frozen=True)
class Stream:
    def fake(self) -> Any:
        return make_fake_stream()


Kind = Ptr | Buffer | Scalar | Stream


@dataclass(frozen=True)
class Param:
    name: str
    kind: Kind


Signature = tuple[Param, ...]


def fake_arguments(signature: Signature) -> list[Any]:
    """Compile-time stand-ins for every parameter, in order."""
    return [param.kind.fake() for param in signature]
