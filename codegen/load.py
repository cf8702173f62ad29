"""Reading the presets files: every table becomes a validated preset dataclass, or an error naming it.

The in-repo models' tables are in the repository's root ``presets.toml`` (``[<key>.<name>]``); a
model kept outside the repository declares its own file (``Model.presets_file``), read the same
way, which holds that model's tables only. A table in the root file for a model the registry does
not know, or for one that ships its own file, is an error naming it.
An error names the file, the table, the key, the rule and the value, e.g.
``presets.toml: [dsv41.h200-tp4-h5120] key 'rank_lanes': must divide tp (4); got 3``
(the dataclasses' ``PresetError`` gives key, rule and value; this module adds the rest). Beyond the
dataclass's rules, ``codegen.schema`` checks the name against the keys it encodes and the derived
values a table writes; a rule broken by a value codegen filled in blames the key it was derived from.
"""

from __future__ import annotations

import dataclasses
import keyword
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import Model, models, root_presets
from .schema import check_derived, check_name, derived_rules

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
    #: The file holding the model's tables, as the generated modules name it (``Model.presets_source``:
    #: the root presets.toml, or the model's own file), whichever copy the run read (``--presets``):
    #: a copy renders the same bytes.
    source: str = "presets.toml"
    #: The preset class's derived values (``codegen.schema``): key -> the line the module shows.
    derived: dict[str, str] = dataclasses.field(default_factory=dict)

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


#: How codegen fills a two-shot crossover a table leaves out (``mhc_core.protocols``).
CROSSOVER_RULE = "mhc_core.protocols.NVLINK_H200.crossover(tp, hidden)"


def _fill_crossover(allowed: list[str], table: dict[str, Any]) -> dict[str, str]:
    """The cost model's two-shot crossover where the preset class has the field and the table sets none
    (a measured one is written in the table)."""
    if "two_shot_min_tokens" not in allowed or "two_shot_min_tokens" in table:
        return {}
    if not isinstance(table.get("tp"), int) or not isinstance(table.get("hidden"), int):
        return {}  # reported by the preset's own checks
    from mhc_core.protocols import NVLINK_H200

    table["two_shot_min_tokens"] = NVLINK_H200.crossover(table["tp"], table["hidden"]) if table["tp"] > 1 else None
    return {"two_shot_min_tokens": CROSSOVER_RULE}


def _load_preset(model: Model, name: str, table: object, source: str) -> Preset:
    from mhc_core.presets import PresetError

    where = f"{source}: [{model.key}.{name}]"
    if not isinstance(table, dict):
        raise CodegenError([f"{where} must be a table of preset keys; got {table!r}"])
    preset_type = model.preset_type()
    allowed, required = _fields(preset_type)
    table = {key: _tuples(value) for key, value in table.items()}
    derivable = derived_rules(preset_type)
    written = {key: table.pop(key) for key in list(table) if key in derivable and key not in allowed}
    for key, value in table.items():
        if key == "name":
            raise CodegenError([f"{where} {_key_error(key, 'is the table name, not a key', value)}"])
        if key not in allowed:
            expected = ", ".join([*allowed, *(f"{key} (derived)" for key in derivable)])
            rule = f"is not a {model.preset_class} key (expected one of {expected})"
            raise CodegenError([f"{where} {_key_error(key, rule, value)}"])
    description = table.get("description", "")
    if not isinstance(description, str):
        raise CodegenError([f"{where} {_key_error('description', 'must be a string', description)}"])
    if len(description) > MAX_DESCRIPTION or not description.isprintable():
        rule = f"must be one line of at most {MAX_DESCRIPTION} printable characters (it is rendered on one line)"
        raise CodegenError([f"{where} {_key_error('description', rule, description)}"])
    filled: dict[str, str] = {}
    geometry: dict[str, str] = {}  # what a broken rule may blame on hidden
    try:
        geometry = _fill_defaults(model, name, table)
        filled = {**geometry, **_fill_crossover(allowed, table)}
        missing = [key for key in required if key not in table]
        if missing:
            raise CodegenError([f"{where} key {missing[0]!r}: is required; missing"])
        value = preset_type(name=name, **table)
        check_name(name, value)
        derived = check_derived(preset_type, written, value, Path(model.presets_source).name)
    except PresetError as error:
        raise CodegenError([f"{where} {_blamed(error, geometry, table)}"]) from error
    except (TypeError, ValueError, ArithmeticError) as error:
        raise CodegenError([f"{where} {type(error).__name__}: {error}"]) from error
    from mhc_core.presets import module_name

    module = module_name(name)
    if not module.isidentifier() or keyword.iskeyword(module):
        raise CodegenError([f"{where} {_key_error('name', 'must make a Python module name', name)}"])
    return Preset(model=model, name=name, value=value, filled=filled, source=model.presets_source, derived=derived)


def _blamed(error: Any, filled: dict[str, str], table: dict[str, Any]) -> str:
    """``error``'s message, blaming the key really at fault: a rule broken by a value codegen filled
    in (the table never wrote it) is the fault of ``hidden``, which the defaults rule derives the
    geometry from (DSV4.1's ``default_geometry`` reads hidden alone; hc and tp only bound it)."""
    if error.key not in filled:
        return str(error)
    rule = filled[error.key]
    shown = ", ".join(f"{key} = {table[key]!r}" for key in filled)
    return _key_error(
        "hidden",
        f"the geometry {rule} derives for it ({shown}; not in the presets file) breaks a rule of "
        f"{error.key!r}: {error.rule}; write cluster_size, threads and rank_lanes to choose one",
        table["hidden"],
    )


def load_presets(path: Path, owner: Model | None = None, *, root: bool = False) -> list[Preset]:
    """Every preset of ``path``, sorted by model and name; CodegenError lists every bad table.

    ``owner``: the model whose own presets file ``path`` is; a table of another model is an error.
    ``root``: ``path`` is the repository's root file; a table of a model with its own file is an error."""
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
            errors.append(
                f"{source}: [{key}] unknown model: no registered package declares {key!r}; "
                f"expected one of {', '.join(known)}"
            )
            continue
        if not isinstance(tables, dict):
            errors.append(f"{source}: [{key}] must hold [{key}.<name>] tables; got {tables!r}")
            continue
        if owner is not None and model.key != owner.key:
            errors.append(f"{source}: [{key}] is not {owner.key}'s: {key}'s tables go in {model.presets_source}")
            continue
        if root and model.presets_path is not None:
            own = display(model.presets_path)
            errors.append(f"{source}: [{key}] {key} ships its own presets file: its tables go there ({own})")
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
    """The repository's root presets file, then each registered model's own file, in key order."""
    return [root_presets(), *(model.presets_path for model in models().values() if model.presets_path is not None)]


def load_files(paths: list[Path]) -> list[Preset]:
    """Every preset of every file in ``paths``; a preset given twice is an error naming both files.
    A model's own presets file may hold that model's tables only; the root file (``root_presets``)
    those of the models without one."""
    owners = {model.presets_path.resolve(): model for model in models().values() if model.presets_path is not None}
    presets: list[Preset] = []
    errors: list[str] = []
    seen: dict[str, str] = {}
    for path in paths:
        try:
            resolved = path.resolve()
            loaded = load_presets(path, owners.get(resolved), root=resolved == root_presets().resolve())
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
