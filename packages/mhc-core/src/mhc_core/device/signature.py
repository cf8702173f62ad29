"""Kernel signatures: described once, turned into compile-time fakes (and, on the host, arguments).

Every kernel class lists its ``@cute.jit __call__`` parameters as a tuple of
``Param``s. The compiler builds the fakes from it (no positional fake lists at
compile sites), the host binds every parameter's source (``mhc_core.host.calls.programs``), and the
exported kernels' manifests carry it (``to_json`` / ``from_json``), so a shipped kernel is bound
without its kernel class. Plain Python: the DSL is imported only to build fakes (a dtype is the
DSL's type where a kernel module names it, its name where a manifest does):

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


@dataclass(frozen=True)
class Ptr:
    """A per-call tensor passed as a pointer to its first element."""

    dtype: Any
    align: int = 16

    def fake(self) -> Any:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_ptr

        return make_ptr(self.dtype, 0, cute.AddressSpace.gmem, assumed_align=self.align)


@dataclass(frozen=True)
class Buffer:
    """A persistent 1-D tensor: ``extent`` elements, or dynamic with ``divisibility``."""

    dtype: Any
    extent: int | None = None
    divisibility: int = 1
    align: int = 16

    def fake(self) -> Any:
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        extent = self.extent if self.extent is not None else cute.sym_int(divisibility=self.divisibility)
        return make_fake_compact_tensor(self.dtype, (extent,), assumed_align=self.align)


@dataclass(frozen=True)
class Scalar:
    dtype: Any

    def fake(self) -> Any:
        return self.dtype(0)


@dataclass(frozen=True)
class Stream:
    def fake(self) -> Any:
        from cutlass.cute.runtime import make_fake_stream

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


_KINDS = {"Ptr": Ptr, "Buffer": Buffer, "Scalar": Scalar, "Stream": Stream}


def _dtype_name(dtype: Any) -> str:
    return dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))


def to_json(signature: Signature) -> list[dict[str, Any]]:
    """The signature as a manifest stores it (dtypes by name)."""
    entries = []
    for param in signature:
        kind = param.kind
        entry: dict[str, Any] = {"name": param.name, "kind": type(kind).__name__}
        for field in ("dtype", "align", "extent", "divisibility"):
            if hasattr(kind, field):
                value = getattr(kind, field)
                entry[field] = _dtype_name(value) if field == "dtype" else value
        entries.append(entry)
    return entries


def from_json(entries: list[dict[str, Any]]) -> Signature:
    """A signature read back from a manifest (dtypes as names: enough to bind, not to compile)."""
    params = []
    for entry in entries:
        fields = {key: value for key, value in entry.items() if key not in ("name", "kind")}
        params.append(Param(entry["name"], _KINDS[entry["kind"]](**fields)))
    return tuple(params)
