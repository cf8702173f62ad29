"""A kernel key's normal form of a module is the same under every Python release (issue #34): a wheel
built under one release must find its kernels on a host running another (the H200 host runs 3.12,
wheels here are built under 3.11; ``ast.dump`` differs between them and 3.13). Each interpreter
found here loads ``mhc_core/host/binaries/source_form.py`` alone and hashes every module of the packages."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FORM = ROOT / "packages" / "mhc-core" / "src" / "mhc_core" / "host" / "binaries" / "source_form.py"
OTHER_PYTHONS = ("python3.10", "python3.12", "python3.13")

HASH_EVERY_MODULE = """
import ast, hashlib, importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("source_form", sys.argv[1])
source_form = importlib.util.module_from_spec(spec)
spec.loader.exec_module(source_form)
digests = {}
for path in sorted(Path(sys.argv[2]).glob("packages/*/src/**/*.py")):
    tree = ast.parse(path.read_bytes(), str(path))
    digests[str(path.relative_to(sys.argv[2]))] = hashlib.sha256(source_form.normal_form(tree)).hexdigest()
print(json.dumps(digests))
"""


def _interpreter(name: str) -> str | None:
    """``name`` on PATH, or a pyenv version of it, if it runs."""
    candidates = [shutil.which(name)]
    candidates += sorted(str(path) for path in Path.home().glob(f".pyenv/versions/{name[6:]}*/bin/python"))
    for candidate in filter(None, candidates):
        if subprocess.run([candidate, "-c", "pass"], capture_output=True).returncode == 0:
            return candidate
    return None


def _digests(python: str) -> dict[str, str]:
    result = subprocess.run(
        [python, "-c", HASH_EVERY_MODULE, str(SOURCE_FORM), str(ROOT)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", OTHER_PYTHONS)
def test_every_module_has_one_normal_form_under_every_python(name: str) -> None:
    python = _interpreter(name)
    if python is None:
        pytest.skip(f"{name} is not installed here")
    mine, theirs = _digests(sys.executable), _digests(python)
    assert mine.keys() == theirs.keys()
    differ = sorted(path for path in mine if mine[path] != theirs[path])
    assert not differ, (
        f"{name} gives {len(differ)} modules another normal form than {sys.version.split()[0]}: {differ[:5]}"
    )


def test_comments_docstrings_and_formatting_keep_the_normal_form() -> None:
    import ast

    from mhc_core.host.binaries.source_form import normal_form

    plain = "def f(a, b):\n    return a + b\n"
    edited = '# a comment\ndef f(\n    a,\n    b,\n):\n    """Adds."""\n    return (a + b)  # why\n'
    assert normal_form(ast.parse(plain)) == normal_form(ast.parse(edited))
    assert normal_form(ast.parse(plain)) != normal_form(ast.parse(plain.replace("+", "-")))
    assert hashlib.sha256(normal_form(ast.parse(plain))).hexdigest()  # bytes, hashable as the key does
