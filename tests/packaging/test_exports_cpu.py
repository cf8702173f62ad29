"""What a user of one model package reaches from it alone: the op, its presets as an attribute, the
core's names it needs (re-exported, one object each), ``supports(m)`` on both ops, and the ``mhc``
logger's compile records."""

from __future__ import annotations

import logging

import pytest

CORE_NAMES = ("MoEOutput", "LoopbackGroup", "LamportTimeoutError", "TokenCountError", "RouteIndexError")


@pytest.mark.parametrize("package", ["mhc_dsv41", "mhc_glm5"])
def test_model_packages_reexport_the_core_names(package: str) -> None:
    import importlib

    import mhc_core

    module = importlib.import_module(package)
    for name in CORE_NAMES:
        assert getattr(module, name) is getattr(mhc_core, name), name
        assert name in module.__all__
    assert module.presets.names(), "presets reachable as an attribute"
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        module.nothing  # noqa: B018


def test_both_ops_have_supports() -> None:
    from mhc_dsv41 import AllReduceMHC
    from mhc_glm5 import AllReduceMhcBoundary

    for op_type in (AllReduceMHC, AllReduceMhcBoundary):
        assert callable(op_type.supports), op_type


def test_compile_times_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    from mhc_core.device.publish import PublishConfig, PublishKernel
    from mhc_core.host.binaries.compiler import compile_kernel

    with caplog.at_level(logging.INFO, logger="mhc"):
        compile_kernel(PublishKernel(PublishConfig(hidden=1040, tp=2, threads=64)), "sm_90a")
    assert any(r.name == "mhc" and "compiled PublishKernel" in r.getMessage() for r in caplog.records)
