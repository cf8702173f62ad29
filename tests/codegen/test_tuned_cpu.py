"""Untuned presets say so: ``tuned`` is a preset field, and building an op from a preset without it
logs a warning on the ``mhc`` logger (``mhc_core.presets.warn_if_untuned``, called by both ops'
``from_config`` before anything else)."""

from __future__ import annotations

import logging

import pytest

TUNED = {"dsv41": {"h200-tp1-h5120", "h200-tp2-h5120"}, "glm5": {"h200-tp1-h4096", "h200-tp2-h4096"}}


@pytest.mark.parametrize("model", sorted(TUNED))
def test_only_the_measured_presets_are_tuned(model: str) -> None:
    import importlib

    presets = importlib.import_module(f"mhc_{model}.presets")
    tuned = {name for name in presets.names() if presets.get(name).PRESET.tuned}
    assert tuned == TUNED[model]


@pytest.mark.parametrize("model", sorted(TUNED))
def test_untuned_presets_log_a_warning(model: str, caplog: pytest.LogCaptureFixture) -> None:
    import importlib

    from mhc_core.presets import warn_if_untuned

    presets = importlib.import_module(f"mhc_{model}.presets")
    for name in presets.names():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mhc"):
            warned = warn_if_untuned(presets.get(name).PRESET)
        assert warned == (name not in TUNED[model])
        messages = [record.getMessage() for record in caplog.records if record.name == "mhc"]
        assert bool(messages) == warned
        if warned:
            assert f"preset {name!r} is untuned" in messages[0]


@pytest.mark.parametrize("module", ["mhc_dsv41.op", "mhc_glm5.op"])
def test_from_config_warns_before_building(module: str, caplog: pytest.LogCaptureFixture) -> None:
    """The warning comes first, before the op's own checks (here: max_num_tokens = 0 fails them,
    before any CUDA call)."""
    import importlib

    op = importlib.import_module(module)
    cls = op.AllReduceMHC if module == "mhc_dsv41.op" else op.AllReduceMhcBoundary
    model = "dsv41" if module == "mhc_dsv41.op" else "glm5"
    presets = importlib.import_module(f"mhc_{model}.presets")
    untuned = next(name for name in presets.names() if name not in TUNED[model])
    with caplog.at_level(logging.WARNING, logger="mhc"), pytest.raises(ValueError, match="max_num_tokens"):
        cls.from_preset(untuned, max_num_tokens=0, device="cuda")
    assert any(f"preset {untuned!r} is untuned" in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("model", ["dsv41", "glm5"])
def test_an_untuned_preset_s_repr_says_what_that_means(model: str) -> None:
    """Issue #49: ``find_preset`` returned presets marked ``tuned=False`` with no word on what it means."""
    import importlib

    from mhc_core import registry

    presets = importlib.import_module(registry.model(model).presets_package)
    modules = [presets.get(name) for name in presets.names()]
    untuned = [module.PRESET for module in modules if not module.PRESET.tuned]
    tuned = [module.PRESET for module in modules if module.PRESET.tuned]
    assert untuned and tuned, model
    for preset in untuned:
        text = repr(preset)
        assert "tuned=False" in text and "  # untuned: its geometry was not measured on its target" in text, text
        assert "python3 -m benchmarks.run" in text and "presets.toml" in text
        assert eval(text, vars(importlib.import_module(type(preset).__module__))) == preset
    for preset in tuned:
        assert "#" not in repr(preset).split(")")[-1], repr(preset)
