"""The base of every kernel class: a frozen config of compile-time constants, a signature, a name.

``mhc_core.host.binaries.compiler.compile_kernel`` compiles any of them (for any arch, without a GPU), or
loads it shipped; ``KernelSpec`` names one without importing it (a preset module's pure data).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

from .signature import Signature


class DeviceKernel:
    """Base of every kernel class: a config, a signature, a name for reports."""

    #: Short name used in build tables and compile-cache keys.
    name: ClassVar[str] = "kernel"
    #: The frozen dataclass of compile-time constants this kernel takes.
    config_type: ClassVar[type | None] = None

    def __init__(self, config: Any) -> None:
        self.config = config

    def signature(self) -> Signature:
        raise NotImplementedError

    def entry(self) -> Any:
        """The ``@cute.jit`` function ``compile_kernel`` compiles; its parameters must be exactly
        ``signature()``'s (TVM-FFI expects every parameter, a defaulted ``None`` one included).
        The instance itself (its ``__call__``) unless a class has one entry per config."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


@dataclass(frozen=True)
class KernelSpec:
    """A kernel by name: its class's ``"package.module:Class"`` path and its config (the config
    dataclass, or a dict of its fields: the preset modules' plain data). Naming a kernel imports
    nothing; ``instantiate`` imports its class (and the DSL)."""

    path: str
    config: Any

    @staticmethod
    def of(kernel: DeviceKernel | KernelSpec) -> KernelSpec:
        if isinstance(kernel, KernelSpec):
            return kernel
        kind = type(kernel)
        return KernelSpec(f"{kind.__module__}:{kind.__qualname__}", kernel.config)

    def instantiate(self) -> DeviceKernel:
        module_name, _, class_name = self.path.partition(":")
        kernel_type = getattr(importlib.import_module(module_name), class_name)
        if kernel_type.config_type is None:
            raise TypeError(f"{self.path} declares no config_type")
        config = self.config if not isinstance(self.config, dict) else kernel_type.config_type(**self.config)
        return kernel_type(config)  # type: ignore[no-any-return]

    def __str__(self) -> str:
        return self.path.rpartition(":")[2] + f"({self.config})"
