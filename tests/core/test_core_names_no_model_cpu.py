"""The core's host modules name no model (issue #35 part 3): a model's op declares what the core
needs of it (``mhc_core.host.calls.contract.ModelOp``: its hooks and ``model_device_state``), so no
identifier or string of ``mhc_core.host`` is a model's name or one of its ops' own attributes.
Comments and docstrings may still say which model motivated a mechanism.

Nor do the benchmarks (issue #35 part 1): ``benchmarks/`` and the harness it shares with the model
packages (``mhc_core.bench``) iterate the registry; a model's suites and benchmark case are its own
package's (``Model.benchmark_suites``, ``Model.benchmark_case``). There no identifier and no string
names a model, its op class or its own mechanisms."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import mhc_core

HOST = Path(mhc_core.__file__).parent / "host"
ROOT = Path(__file__).resolve().parents[2]
#: The benchmarks' model-free side: the CLI and generic suites, and the harness in mhc-core.
BENCHMARKS = (ROOT / "benchmarks", Path(mhc_core.__file__).parent / "bench")
#: Parts of an identifier that name a model or its own mechanisms (GLM's mixes kernel and arrival
#: counter, Sinkhorn). The Lamport hand-off is the core's (``mhc_core.device.handoff``, the spin guard).
MODEL_WORDS = ("glm", "dsv", "mixes", "sinkhorn", "arrivals")
#: A string literal that is one identifier (an attribute named by a string, as ``getattr`` takes it).
IDENTIFIER = re.compile(r"""^[rRuU]?(['"])(\w+)\1$""")


def code_tokens(path: Path) -> list[tokenize.TokenInfo]:
    """The file's identifiers and string literals (no comments), docstrings left out."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(body[0].lineno)
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [
        token
        for token in tokens
        if token.type == tokenize.NAME or (token.type == tokenize.STRING and token.start[0] not in docstrings)
    ]


def assigned_attributes(path: Path) -> set[str]:
    """Every private attribute a module's classes set or declare (``self._name = ...``, a class body's
    ``_name: T`` or ``_name = ...``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                target = getattr(statement, "target", None) or next(iter(getattr(statement, "targets", [])), None)
                if isinstance(target, ast.Name):
                    names.add(target.id)
    return {name for name in names if name.startswith("_")}


def model_attributes() -> set[str]:
    """The attributes only a model's op sets (the core's own removed)."""
    import mhc_dsv41.op
    import mhc_glm5.op

    model = set()
    for module in (mhc_dsv41.op, mhc_glm5.op):
        model |= assigned_attributes(Path(module.__file__))
    core = set().union(*(assigned_attributes(path) for path in HOST.rglob("*.py")))
    return model - core


def test_the_host_modules_name_no_model_and_none_of_its_attributes() -> None:
    attributes = model_attributes()
    assert {"_mixes_handoff", "_raw_mixes", "_arrivals", "_boundary_kernels"} <= attributes  # the check sees them
    found = []
    for path in sorted(HOST.rglob("*.py")):
        for token in code_tokens(path):
            text = token.string.lower() if token.type == tokenize.NAME else token.string
            words = [word for word in MODEL_WORDS if token.type == tokenize.NAME and word in text]
            literal = IDENTIFIER.match(token.string) if token.type == tokenize.STRING else None
            named = literal is not None and literal.group(2) in attributes
            if words or named:
                found.append(f"{path.name}:{token.start[0]}: {token.string}")
    assert not found, "the core names a model:\n" + "\n".join(found)


def test_the_check_finds_a_model_attribute(tmp_path: Path) -> None:
    """The old ``_device_state`` (GLM's buffers listed in the core) is what the check refuses."""
    old = tmp_path / "op.py"
    old.write_text('"""doc: GLM\'s hand-off rows"""\n_device_state = ("mailbox", "_mixes_handoff")\n')
    strings = [token.string for token in code_tokens(old) if token.type == tokenize.STRING]
    assert strings == ['"mailbox"', '"_mixes_handoff"'] and "_mixes_handoff" in model_attributes()


def model_names() -> tuple[str, ...]:
    """What names a registered model: its key, package and op class, and ``MODEL_WORDS``, lowercase."""
    from mhc_core import registry

    names = set(MODEL_WORDS)
    for model in registry.models().values():
        names |= {model.key.lower(), model.package.lower(), model.op_class.lower()}
    return tuple(sorted(names))


def test_the_benchmarks_name_no_model() -> None:
    names = model_names()
    found = []
    for folder in BENCHMARKS:
        for path in sorted(folder.glob("*.py")):
            for token in code_tokens(path):
                hits = [name for name in names if name in token.string.lower()]
                if hits:
                    found.append(f"{path.relative_to(folder.parent)}:{token.start[0]}: {token.string} ({hits[0]})")
    assert not found, "the benchmarks name a model:\n" + "\n".join(found)
