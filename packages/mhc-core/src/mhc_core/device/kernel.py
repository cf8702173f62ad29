"""The base of every kernel class: a frozen config of compile-time constants, a signature, a name.

``mhc_core.host.compiler.compile_kernel`` compiles any of them (for any arch, without a GPU);
``mhc_core.host.compiler.kernel_from_spec`` builds one from a preset module's pure-data spec.
"""

from __future__ import annotations

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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"
