"""Reading the presets files: every table becomes a validated preset dataclass, or an error naming it.

Each model package keeps its tables in its own presets file (``Model.presets_file``, e.g.
``packages/mhc-dsv41/presets.toml``), which holds that model's ``[<key>.<name>]`` tables only.
An error names the file, the table, the key, the rule and the value, e.g.
``packages/mhc-dsv41/presets.toml: [dsv41.h200-tp4-h5120] key 'rank_lanes': must divide tp (4); got 3``
(the dataclasses' ``PresetError`` gives key, rule and value; this module adds the rest).
"""

from __future__ import annotations

import dataclasses
import keyword
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import Model, models

#: Longest ``description``: it must fit one line of the generated module.
MAX_DESCRIPTION = 100


class CodegenError(Exception):
    """Something stops the run before anything is written; ``messages`` has one line per problem."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = messages


@dataclass(frozen=True)
class Preset:
    """One validated table of a presets file."""

    model: Model
    name: str
    value: Any  # the model's preset dataclass
    #: Keys the table left out that codegen filled, with the rule that filled them.
    filled: dict[str, str]
    #: The model's own presets file, as the generated modules name it (``Model.presets_source``),
    #: whichever copy the run read (``--presets``): a copy renders the same bytes. The name of the
    #: file read for a model that declares none.
    source: str = "presets.toml"

    @property
    def section(self) -> str:
        return f"{self.model.key}.{self.name}"


def display(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it, else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _key_error(key: str, rule: str, value: object) -> str:
    # The shape of mhc_core.presets.PresetError's message.
    return f"key {key!r}: {rule}; got {value!r}"


def _tuples(value: Any) -> Any:
    """TOML arrays become tuples, nested ones too (the dataclasses hold tuples)."""
    if isinstance(value, list):
        return tuple(_tuples(item) for item in value)
    return value


def _fields(preset_type: type) -> tuple[list[str], list[str]]:
    """The dataclass's keys a table may give (``name`` comes from the table) and those it must."""
    allowed, required = [], []
    for field in dataclasses.fields(preset_type):
        if field.name == "name":
            continue
        allowed.append(field.name)
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            required.append(field.name)
    return allowed, required


def _fill_defaults(model: Model, name: str, table: dict[str, Any]) -> dict[str, str]:
    """Fill the keys the model's defaults rule covers and the table left out (DSV4.1's geometry)."""
    function = model.defaults_function()
    if function is None:
        return {}
    from mhc_core.presets import require_hidden, require_name

    # The rule needs a valid name and hidden; check them as the dataclass would, so the error is the same.
    require_name(name)
    for key in ("hidden", "hc", "tp"):
        if key not in table:
            return {}  # reported as missing below
    require_hidden(table["hidden"])
    defaults = function(table["hidden"], table["hc"], table["tp"])
    filled = {}
    for key, value in defaults.items():
        if key not in table:
            table[key] = value
            filled[key] = f"{model.defaults}(hidden, hc, tp)"
    return filled


def _load_preset(model: Model, name: str, table: object, source: str) -> Preset:
    from mhc_core.presets import PresetError

    where = f"{source}: [{model.key}.{name}]"
    if not isinstance(table, dict):
        raise CodegenError([f"{where} must be a table of preset keys; got {table!r}"])
    preset_type = model.preset_type()
    allowed, required = _fields(preset_type)
    table = {key: _tuples(value) for key, value in table.items()}
    for key, value in table.items():
        if key == "name":
            raise CodegenError([f"{where} {_key_error(key, 'is the table name, not a key', value)}"])
        if key not in allowed:
            rule = f"is not a {model.preset_class} key (expected one of {', '.join(allowed)})"
            raise CodegenError([f"{where} {_key_error(key, rule, value)}"])
    description = table.get("description", "")
    if not isinstance(description, str):
        raise CodegenError([f"{where} {_key_error('description', 'must be a string', description)}"])
    if len(description) > MAX_DESCRIPTION or not description.isprintable():
        rule = f"must be one line of at most {MAX_DESCRIPTION} printable characters (it is rendered on one line)"
        raise CodegenError([f"{where} {_key_error('description', rule, description)}"])
    try:
        filled = _fill_defaults(model, name, table)
        missing = [key for key in required if key not in table]
        if missing:
            raise CodegenError([f"{where} key {missing[0]!r}: is required; missing"])
        value = preset_type(name=name, **table)
    except PresetError as error:
        raise CodegenError([f"{where} {error}"]) from error
    except (TypeError, ValueError, ArithmeticError) as error:
        raise CodegenError([f"{where} {type(error).__name__}: {error}"]) from error
    from mhc_core.presets import module_name

    module = module_name(name)
    if not module.isidentifier() or keyword.iskeyword(module):
        raise CodegenError([f"{where} {_key_error('name', 'must make a Python module name', name)}"])
    quoted = model.presets_source or Path(source).name
    return Preset(model=model, name=name, value=value, filled=filled, source=quoted)


def load_presets(path: Path, owner: Model | None = None) -> list[Preset]:
    """Every preset of ``path``, sorted by model and name; CodegenError lists every bad table.

    ``owner``: the model whose own presets file ``path`` is; a table of another model is an error."""
    source = display(path)
    try:
        with path.open("rb") as stream:
            document = tomllib.load(stream)
    except FileNotFoundError:
        raise CodegenError([f"{source}: no such file"]) from None
    except tomllib.TOMLDecodeError as error:
        raise CodegenError([f"{source}: invalid TOML: {error}"]) from None
    presets: list[Preset] = []
    errors: list[str] = []
    known = models()
    for key, tables in document.items():
        model = known.get(key)
        if model is None:
            errors.append(f"{source}: [{key}] unknown model; expected one of {', '.join(known)}")
            continue
        if not isinstance(tables, dict):
            errors.append(f"{source}: [{key}] must hold [{key}.<name>] tables; got {tables!r}")
            continue
        if owner is not None and model.key != owner.key:
            where = f" ({model.presets_source})" if model.presets_source else ""
            errors.append(f"{source}: [{key}] is not {owner.key}'s: {key}'s tables go in its own presets file{where}")
            continue
        for name, table in tables.items():
            try:
                presets.append(_load_preset(model, name, table, source))
            except CodegenError as error:
                errors.extend(error.messages)
    if errors:
        raise CodegenError(errors)
    return sorted(presets, key=lambda preset: (preset.model.key, preset.name))


def default_files() -> list[Path]:
    """Each registered model's own presets file, in key order (a model without one has no presets)."""
    return [model.presets_path for model in models().values() if model.presets_path is not None]


def load_files(paths: list[Path]) -> list[Preset]:
    """Every preset of every file in ``paths``; a preset given twice is an error naming both files.
    A model's own presets file (``default_files``) may hold that model's tables only."""
    owners = {model.presets_path.resolve(): model for model in models().values() if model.presets_path is not None}
    presets: list[Preset] = []
    errors: list[str] = []
    seen: dict[str, str] = {}
    for path in paths:
        try:
            loaded = load_presets(path, owners.get(path.resolve()))
        except CodegenError as error:
            errors.extend(error.messages)
            continue
        for preset in loaded:
            if preset.section in seen:
                errors.append(f"{display(path)}: [{preset.section}] already given in {seen[preset.section]}")
            seen[preset.section] = display(path)
            presets.append(preset)
    if errors:
        raise CodegenError(errors)
    return sorted(presets, key=lambda preset: (preset.model.key, preset.name))
