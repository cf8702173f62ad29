"""Kernel parameter bundles (issue #50): the DSL names a kernel after its parameters' ``str``, so a
bundle must name itself as its fields would one by one, or every entry's PTX name changes."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass

import pytest


def test_a_bundle_names_itself_as_its_fields_and_stays_frozen() -> None:
    from mhc_core.device import bundle

    @dataclass(frozen=True)
    class Pair(bundle.KernelBundle):
        first: object
        second: object

    pair = Pair("ptrbf16gmemalign16", "ptrf32gmem")
    assert str(pair) == "ptrbf16gmemalign16_ptrf32gmem"
    assert bundle.values(pair) == ("ptrbf16gmemalign16", "ptrf32gmem")
    with pytest.raises(FrozenInstanceError):
        pair.first = "x"  # type: ignore[misc]


def test_the_entries_bundles_hold_their_signatures_names_in_order() -> None:
    from dataclasses import fields

    from mhc_dsv41.kernel import Exchange, LamportMHCKernel, LayerOutputs, MixInputs, SublayerOutput

    names = [field.name for kind in (MixInputs, LayerOutputs) for field in fields(kind)]
    names += ["eps", *(field.name for kind in (SublayerOutput, Exchange) for field in fields(kind)), "m"]
    kernel = LamportMHCKernel.__new__(LamportMHCKernel)
    kernel.config = type("Config", (), {"quantizes": False})()
    signature = [param.name for param in kernel.signature()]
    assert [name for name in signature if name not in ("clusters", "stream")] == names
