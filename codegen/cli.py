"""``python3 -m codegen [--check] [--presets PATH] [--root PATH]``: render or check the preset modules."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .load import CodegenError, default_files, display, load_files
from .models import REPO, ensure_importable, models
from .render import MARKER, Output, render_all


def _is_generated(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as stream:
            return MARKER in stream.readline()
    except (OSError, UnicodeDecodeError):
        return False


def plan(outputs: list[Output], root: Path) -> tuple[list[Output], list[Output], list[Path]]:
    """(stale, missing, orphaned): files to rewrite, to create, and to remove under each ``presets/``."""
    stale, missing = [], []
    for output in outputs:
        if not output.path.exists():
            missing.append(output)
        elif output.path.read_text(encoding="utf-8") != output.text:
            stale.append(output)
    expected = {output.path for output in outputs}
    orphaned = []
    for model in models().values():
        for directory in model.output_dirs(root):
            if directory.is_dir():
                orphaned.extend(
                    path for path in sorted(directory.iterdir()) if path.name != "__pycache__" and path not in expected
                )
    return stale, missing, orphaned


def check_root(root: Path) -> None:
    known = models().values()
    absent = [model.output_dir(root).parent for model in known if not model.output_dir(root).parent.is_dir()]
    if absent:
        raise CodegenError([f"{display(root)}: no package folder {display(path)} to generate into" for path in absent])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m codegen",
        description=(
            "Validate every model package's presets file and render one module per preset "
            "(and a registry per model package)."
        ),
    )
    parser.add_argument("--check", action="store_true", help="write nothing; name stale, missing, orphaned files")
    parser.add_argument(
        "--presets",
        type=Path,
        action="append",
        help="a presets file (repeatable); default: each model package's own (Model.presets_file in its folder)",
    )
    parser.add_argument("--root", type=Path, default=REPO, help="tree whose packages/ receive the modules")
    args = parser.parse_args(argv)
    ensure_importable()
    root: Path = args.root
    try:
        check_root(root)
        presets = load_files(args.presets or default_files())
        outputs = render_all(presets, root)
        stale, missing, orphaned = plan(outputs, root)
        foreign = [path for path in orphaned if not (path.suffix == ".py" and _is_generated(path))]
        if foreign and not args.check:
            raise CodegenError(
                [f"{display(path)}: not generated, yet in a generated presets/ folder: move it" for path in foreign]
            )
    except CodegenError as error:
        for message in error.messages:
            print(f"error: {message}", file=sys.stderr)
        print("nothing was written", file=sys.stderr)
        return 2

    if args.check:
        problems = [f"stale: {display(o.path)} (differs from what {o.origin} renders)" for o in stale]
        problems += [f"missing: {display(o.path)} ({o.origin} renders it)" for o in missing]
        problems += [f"orphaned: {display(path)} (no preset renders it)" for path in orphaned]
        if problems:
            for problem in problems:
                print(problem, file=sys.stderr)
            print(f"{len(problems)} generated file(s) out of date: run `python3 -m codegen`", file=sys.stderr)
            return 1
        print(f"codegen --check: {len(outputs)} generated files up to date ({len(presets)} presets)")
        return 0

    for output in (*stale, *missing):
        output.path.parent.mkdir(parents=True, exist_ok=True)
        output.path.write_text(output.text, encoding="utf-8", newline="\n")
        print(f"wrote {display(output.path)}")
    for path in orphaned:
        path.unlink()
        print(f"removed {display(path)} (no preset renders it)")
    unchanged = len(outputs) - len(stale) - len(missing)
    print(f"codegen: {len(presets)} presets, {len(outputs)} files ({unchanged} unchanged)")
    return 0
