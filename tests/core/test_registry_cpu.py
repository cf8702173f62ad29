"""The model registry (``mhc_core.registry``): what each model declares resolves, an unknown key is a
clear error, and a package outside the checkout is found through ``MHC_MODEL_PATH``."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest

from mhc_core import registry


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch):
    """The registry rediscovered for one test, and again after it (the environment restored)."""
    monkeypatch.delenv(registry.PATH_ENV, raising=False)
    registry.refresh()
    yield registry
    monkeypatch.undo()
    registry.refresh()


def test_every_declared_name_resolves() -> None:
    models = registry.models()
    assert models, "the checkout's model packages are found"
    for key, model in models.items():
        assert model.key == key and model.source is not None, model
        assert model.load_preset_type().__name__ == model.preset_class
        assert model.load_op_type().__name__ == model.op_class
        for module in (model.reference, model.custom_ops, model.presets_package, *model.device_modules):
            if module is not None:
                assert importlib.util.find_spec(module) is not None, (key, module)
        assert model.load_defaults() is None or callable(model.load_defaults())
    assert registry.packages() == tuple(model.package for model in models.values())


def test_an_unknown_model_names_the_known_ones() -> None:
    known = ", ".join(registry.models())
    with pytest.raises(ValueError, match=f"unknown model 'llama'; known: {known}$"):
        registry.model("llama")


def test_a_declaration_is_checked() -> None:
    with pytest.raises(ValueError, match=r"expected 'package\.module:name', got 'nocolon'"):
        registry.Model(key="x", title="X", distribution="x", package="x", preset_type="nocolon", op_type="a:B")
    with pytest.raises(ValueError, match=r"Model\.key: expected an identifier, got 'a-b'"):
        registry.Model(key="a-b", title="X", distribution="x", package="x", preset_type="a:B", op_type="a:B")


def _package(folder: Path, key: str, package: str) -> Path:
    (folder / "src" / package).mkdir(parents=True)
    (folder / "pyproject.toml").write_text(
        textwrap.dedent(f"""
            [project]
            name = "{package}"
            version = "0"
            [project.entry-points."mhc_kernels.models"]
            {key} = "{package}.model:MODEL"
        """)
    )
    (folder / "src" / package / "__init__.py").write_text("")
    (folder / "src" / package / "model.py").write_text(
        "from mhc_core.registry import Model\n"
        f"MODEL = Model(key={key!r}, title='T', distribution='d', package={package!r},\n"
        f"              preset_type='{package}.config:P', op_type='{package}.op:Op')\n"
    )
    return folder


def test_a_folder_on_the_model_path_registers(fresh_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _package(tmp_path / "one", "regone", "mhcregone")
    monkeypatch.setenv(registry.PATH_ENV, str(folder))
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test (the registry appends src/)
    fresh_registry.refresh()
    model = fresh_registry.model("regone")
    assert model.source == folder.resolve() and model.package == "mhcregone"
    assert "mhcregone" in fresh_registry.packages()


def test_one_key_declared_twice_is_an_error(fresh_registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _package(tmp_path / "a", "regtwice", "mhcregtwicea")
    second = _package(tmp_path / "b", "regtwice", "mhcregtwiceb")
    monkeypatch.setenv(registry.PATH_ENV, f"{first}:{second}")
    monkeypatch.syspath_prepend(str(tmp_path))  # undone after the test (the registry appends src/)
    fresh_registry.refresh()
    with pytest.raises(ValueError, match="model 'regtwice' declared twice"):
        fresh_registry.models()
