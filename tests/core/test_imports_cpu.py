"""Every import of the packages' modules, read from the sources (``TYPE_CHECKING`` and
function-local ones included, so imports that only GPU code paths execute are checked too):

* each ``mhc_*`` import names a module that exists, and every name it takes from it exists there
  (tests, benchmarks and tools included);
* each ``benchmarks`` import (the demo, the tests) names a module there and names it has; no package
  module imports ``benchmarks`` or another checkout folder (a wheel ships without them);
* device modules (``mhc_core.device``, the model packages' kernel modules) never import host ones;
* the folders of ``mhc_core.host`` and ``mhc_core.device`` are floors: a module imports its own
  folder's and lower floors' modules, never a higher floor's nor a sibling folder's on its floor;
* the host modules form no import cycle. Preset modules import their op (their ``build``) and the
  op imports the preset registry (``from_preset``): the registry imports presets by name, at run
  time, so no cycle runs through them and none is excepted.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

from mhc_core import registry

ROOT = Path(__file__).resolve().parents[2]
#: mhc-core and every registered model package (``mhc_core.registry``): no model is named here.
MODELS = registry.models()
SOURCES = [ROOT / "packages" / "mhc-core" / "src"] + [
    (model.source / "src") if model.source is not None else ROOT / "packages" / model.distribution / "src"
    for model in MODELS.values()
]
#: Folders of the repository that ship in no wheel (``python3 -m <folder>...`` from a checkout).
CHECKOUT_FOLDERS = ("tests", "benchmarks", "tools", "codegen", "demo", "examples")
DEVICE_PREFIXES = ("mhc_core.device",)
#: The models' device modules, as each declares them.
DEVICE_MODULES = {module for model in MODELS.values() for module in model.device_modules}
#: Pure modules both layers share (constants, preset rules, each model's config); neither layer's.
SHARED = {
    "mhc_core",
    "mhc_core.constants",
    "mhc_core.presets",
    "mhc_core.compat",
    "mhc_core.fp8_formats",  # the FP8 format table and the kernel configs' layer-input mixin (pure Python)
    *(model.config_module for model in MODELS.values()),
}


#: The floors of each layer, lowest first: a folder (a package) per name, its modules and the
#: modules of no lower-listed subfolder; folders on one floor import each other in neither direction.
FLOORS = {
    "mhc_core.host": (
        ("mhc_core.host.binaries",),  # compiled code: compiler, shipped and cached kernels, native/
        ("mhc_core.host.ranks", "mhc_core.host.calls"),  # the group and its memory; the call path
        ("mhc_core.host",),  # the ops
    ),
    "mhc_core.device": (
        ("mhc_core.device",),  # what both protocols and the models' kernels share
        ("mhc_core.device.one_shot", "mhc_core.device.two_shot"),  # each protocol's own kernels
    ),
}


def package_modules() -> dict[str, Path]:
    modules = {}
    for source in SOURCES:
        for path in source.rglob("*.py"):
            parts = list(path.relative_to(source).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = package_modules()


def is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks (what type checkers read, never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for statement in node.body:
                skipped.update(id(inner) for inner in ast.walk(statement))
    return skipped


def imports(path: Path, module: str | None, run_time: bool = False) -> list[tuple[str, list[str], int]]:
    """Every import in ``path``: (absolute module, the names taken from it, line); ``run_time``: only
    those that can run (not in ``if TYPE_CHECKING:`` blocks)."""
    found = []
    tree = ast.parse(path.read_text())
    skipped = type_checking_only(tree) if run_time else set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                if module is None:  # a relative import of tests/, benchmarks/ ...: not a package module
                    continue
                base = module.split(".") if is_package(module) else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                name = ".".join([*base, *([name] if name else [])])
            found.append((name, [alias.name for alias in node.names], node.lineno))
    return found


def edges(run_time: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name that is a submodule counts as that module);
    ``run_time``: the imports that can run only."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module, path in MODULES.items():
        for target, names, _ in imports(path, module, run_time):
            if not target.startswith("mhc_"):
                continue
            submodules = [f"{target}.{name}" for name in names if f"{target}.{name}" in MODULES]
            graph[module].update(submodules or [target])
    return graph


def is_device(module: str) -> bool:
    return module.startswith(DEVICE_PREFIXES) or module in DEVICE_MODULES


def test_every_import_resolves() -> None:
    files = {path: module for module, path in MODULES.items()}
    for folder in CHECKOUT_FOLDERS:
        files.update({path: None for path in (ROOT / folder).rglob("*.py")})
    missing = []
    for path, module in sorted(files.items()):
        for target, names, line in imports(path, module):
            if not target.startswith("mhc_"):
                continue
            missing += unresolved(f"{path.relative_to(ROOT)}:{line}", target, names, MODULES.__contains__)
    assert not missing, "\n".join(missing)


def unresolved(where: str, target: str, names: list[str], is_module: Callable[[str], bool]) -> list[str]:
    """What of one import does not resolve: its module, else each name neither an attribute nor a submodule."""
    if not is_module(target):
        return [f"{where}: no module {target}"]
    imported = importlib.import_module(target)
    return [
        f"{where}: {target} has no {name}"
        for name in names
        if not hasattr(imported, name) and not is_module(f"{target}.{name}")
    ]


def findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a name under a module that is no package
        return False


def test_no_package_imports_a_checkout_folder() -> None:
    """A wheel holds its package only: a model's benchmark suites take the harness from ``mhc_core.bench``,
    never from the repository's ``benchmarks/``."""
    wrong = [
        f"{MODULES[module].relative_to(ROOT)}:{line}: {target}"
        for module, path in MODULES.items()
        for target, _, line in imports(path, module)
        if target.split(".")[0] in CHECKOUT_FOLDERS
    ]
    assert not wrong, "\n".join(wrong)


def test_every_benchmarks_import_resolves() -> None:
    """Imports of ``benchmarks.*`` (the demo, the tests) name a module there and names it has."""
    missing = []
    for folder in CHECKOUT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for target, names, line in imports(path, None):
                if target.split(".")[0] != "benchmarks":
                    continue
                missing += unresolved(f"{path.relative_to(ROOT)}:{line}", target, names, findable)
    assert not missing, "\n".join(missing)


def test_device_modules_import_no_host_module() -> None:
    graph = edges()
    wrong = [
        f"{module} imports {target}"
        for module in graph
        if is_device(module)
        for target in graph[module]
        if not is_device(target) and target not in SHARED
    ]
    assert not wrong, "\n".join(wrong)


def test_host_modules_form_no_cycle() -> None:
    """Of the imports that run: ``mhc_core``'s ``if TYPE_CHECKING:`` block names the host modules it
    exports lazily, which import ``mhc_core`` (its version) in turn; a block that never runs closes no cycle."""
    graph = edges(run_time=True)
    host = {module for module in graph if not is_device(module)}
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module] & host):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*trail[trail.index(target) :], target]))
            elif target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in sorted(host):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles between host modules:\n" + "\n".join(cycles)


def folder_floor(module: str, floors: tuple[tuple[str, ...], ...]) -> tuple[str, int]:
    """The folder of ``floors`` that holds ``module`` (the longest that prefixes it) and its floor."""
    folders = {folder: floor for floor, names in enumerate(floors) for folder in names}
    holder = max((f for f in folders if module == f or module.startswith(f + ".")), key=len)
    return holder, folders[holder]


def test_folders_import_downward() -> None:
    """``mhc_core.host``: ``binaries`` below ``ranks`` and ``calls``, below the ops; ``mhc_core.device``:
    the shared modules below the protocol folders. Every import counts, lazy ones too."""
    graph = edges()
    wrong = []
    for layer, floors in FLOORS.items():
        inside = [module for module in graph if module.startswith(layer + ".")]
        assert {folder_floor(module, floors)[0] for module in inside} == {f for names in floors for f in names}
        for module in inside:
            folder, floor = folder_floor(module, floors)
            for target in sorted(graph[module]):
                if target != layer and not target.startswith(layer + "."):
                    continue
                target_folder, target_floor = folder_floor(target, floors)
                if target_folder != folder and target_floor >= floor:
                    wrong.append(f"{module} ({folder}) imports {target} ({target_folder})")
    assert not wrong, "imports that do not run downward:\n" + "\n".join(wrong)


def test_the_graph_sees_the_layers() -> None:
    """The checks above look at real edges: the op imports the kernel configs, each model's op its own
    config, and every declared device module exists."""
    graph = edges()
    assert "mhc_core.device.configs" in graph["mhc_core.host.op"]
    assert "mhc_core.host.ranks.groups" in graph["mhc_core.host.ranks.mailbox"]
    for model in MODELS.values():
        assert model.config_module in graph[model.op_module], model.key
        assert set(model.device_modules) <= set(MODULES), model.key


def test_core_and_tools_name_no_model() -> None:
    """No file outside a model package names a model: mhc-core, codegen and tools iterate the registry
    (model names in docstrings and comments are words, not code; the check reads code)."""
    files = list((ROOT / "packages" / "mhc-core" / "src").rglob("*.py"))
    for folder in ("codegen", "tools"):
        files += list((ROOT / folder).rglob("*.py"))
    names = {name for model in MODELS.values() for name in (model.key, model.package, model.distribution)}
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                words = set(node.value.replace(".", " ").replace(":", " ").split())
                found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in sorted(words & names)]
            elif isinstance(node, ast.Name | ast.alias):
                text = node.id if isinstance(node, ast.Name) else node.name
                if set(text.split(".")) & names:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert not found, "\n".join(found)
