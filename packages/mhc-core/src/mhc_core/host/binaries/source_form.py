"""The normal form of a Python module's source: what a kernel's key hashes of each module it depends
on (``mhc_core.host.binaries.artifacts``), so that comments, docstrings and formatting keep shipped kernels.

It is the syntax tree without docstrings or positions, written out by ``dump``, not ``ast.dump``:
``ast.dump`` changes with the Python release (3.12 writes ``type_params=[]`` on every function and
class, 3.13 leaves empty lists and ``None`` out), so a wheel built on one release would find none
of its kernels on a host running another. ``dump`` leaves out every field holding ``None`` or
``[]``, which makes the fields a release adds as optional invisible. Standard library only: the
cross-release test loads this file alone under each interpreter it finds.
"""

from __future__ import annotations

import ast


def without_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstring of its module, classes and functions removed (in place); a body
    left empty gets ``pass``, as the code would need."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0].value if body and isinstance(body[0], ast.Expr) else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def dump(node: object) -> str:
    """A syntax tree as text: each node's type and its fields in order, those holding ``None`` or
    ``[]`` left out; no positions."""
    if isinstance(node, ast.AST):
        fields = (
            f"{name}={dump(value)}"
            for name in node._fields
            if (value := getattr(node, name, None)) is not None and value != []
        )
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return "[" + ", ".join(dump(item) for item in node) + "]"
    return repr(node)


def normal_form(tree: ast.AST) -> bytes:
    """What a kernel's key hashes of a module: its syntax tree without docstrings, positions or
    comments (``dump``). Formatting, comments and docstrings leave it as it is, and so does the
    Python release."""
    return dump(without_docstrings(tree)).encode()
