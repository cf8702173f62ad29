"""The proof of issue #35: a third model is one package. This test writes a small model package,
``mhc-toy`` (one kernel: the plain all-reduce collective of mhc-core, under the toy's own class),
into a temporary folder, registers it through ``MHC_MODEL_PATH`` (no file of this repository
changes), and runs over it what the two shipped models go through: codegen (its presets from the
package's own presets.toml), ``tools.compile_presets`` (ptxas, no spill), ``tools.export_kernels``
(into the package's ``kernels/``), the shipped-kernel lookup, the benchmarks' suite list, then the
wheel build and, installed from that wheel with the folder off the path, discovery by its entry
point alone and the lookup again. ``docs/adding-a-model.md`` walks through the same package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRESET = "h200-tp2-h1024"
ARCH = "sm_90a"

#: The whole third model: its distribution folder, file by file.
TOY = {
    "pyproject.toml": """
        [build-system]
        requires = ["hatchling>=1.27"]
        build-backend = "hatchling.build"

        [project]
        name = "mhc-toy"
        version = "0.1.0"
        description = "A toy third model: the plain all-reduce collective of mhc-core"
        requires-python = ">=3.11"

        [project.entry-points."mhc_kernels.models"]
        toy = "mhc_toy.model:MODEL"

        [tool.hatch.build.targets.wheel]
        packages = ["src/mhc_toy"]
        # The exported kernels (tools.export_kernels) ship when present.
        artifacts = ["src/mhc_toy/kernels/**"]
    """,
    "presets.toml": f"""
        [toy.{PRESET}]
        description = "H200, TP2: the toy all-reduce over 1024 BF16 values per token"
        hidden = 1024
        tp = 2
        archs = ["{ARCH}"]
    """,
    "src/mhc_toy/__init__.py": '''
        """A toy model package: the plain all-reduce of mhc-core as its one kernel."""

        __version__ = "0.1.0"
    ''',
    "src/mhc_toy/config.py": '''
        """The toy's preset: what codegen validates and renders."""

        from __future__ import annotations

        from dataclasses import dataclass
        from typing import Any

        from mhc_core.device.configs import CollectiveConfig
        from mhc_core.presets import require_archs, require_hidden, require_name, require_tp


        @dataclass(frozen=True, slots=True)
        class ToyPreset:
            name: str
            hidden: int
            tp: int
            archs: tuple[str, ...]
            hc: int = 1
            threads: int = 128
            description: str = ""

            def __post_init__(self) -> None:
                require_name(self.name)
                require_hidden(self.hidden)
                require_tp(self.tp)
                require_archs(self.archs)

            def collective_config(self) -> CollectiveConfig:
                return CollectiveConfig(hidden=self.hidden, tp=self.tp, threads=self.threads)

            def geometry(self) -> dict[str, Any]:
                return {"threads": self.threads, "ctas_per_token": self.collective_config().ctas_per_token}

            def kernel_specs(self, arch: str) -> dict[str, tuple[str, dict[str, Any]]]:
                config = {"hidden": self.hidden, "tp": self.tp, "threads": self.threads, "lanes": 1}
                return {"all_reduce": ("mhc_toy.kernel:ToyAllReduce", config)}
    ''',
    "src/mhc_toy/kernel.py": '''
        """The toy's device code: mhc-core's collective (publish, wait, FP32 tree sum), as its own class."""

        from mhc_core.device.one_shot.collective import CollectiveKernel


        class ToyAllReduce(CollectiveKernel):
            """The plain all-reduce collective (``mhc_core.device.one_shot.collective``)."""
    ''',
    "src/mhc_toy/op.py": '''
        """The toy's op: what a preset module's ``build`` returns."""

        from __future__ import annotations

        from typing import Any


        class ToyOp:
            """Holds its preset; a real model's op allocates its mailbox and launches the kernels."""

            def __init__(self, preset: Any, max_num_tokens: int) -> None:
                self.preset, self.max_num_tokens = preset, max_num_tokens

            @classmethod
            def from_config(cls, preset: Any, *, max_num_tokens: int, device: Any, group: Any = None) -> ToyOp:
                return cls(preset, max_num_tokens)
    ''',
    "src/mhc_toy/model.py": '''
        """The toy's entry in the model registry (entry point ``mhc_kernels.models``)."""

        from mhc_core.registry import Model

        MODEL = Model(
            key="toy",
            title="Toy",
            distribution="mhc-toy",
            package="mhc_toy",
            preset_type="mhc_toy.config:ToyPreset",
            op_type="mhc_toy.op:ToyOp",
            device_modules=("mhc_toy.kernel",),
            presets_file="presets.toml",
            benchmark_suites=(("toy", "mhc_toy.bench:toy_suite"),),
        )
    ''',
    "src/mhc_toy/bench.py": '''
        """The toy's benchmark suite (``python3 -m benchmarks.run --suite toy``)."""


        def toy_suite(ctx, ms):
            """A real model's suite times its op at each M with mhc_core.bench's helpers; the toy has none."""
            return []
    ''',
}

#: The toy's kernel looked up in the manifests of the registered packages (by its full key).
LOOKUP = f"""
import sys
from mhc_core import registry
from mhc_core.host.binaries import artifacts
from mhc_core.host.binaries.compiler import CALLING_CONVENTION
toy = registry.model("toy")
presets = __import__(toy.presets_package, fromlist=["get"])
module = presets.get({PRESET!r})
kernel = module.kernels({ARCH!r})["all_reduce"]
found = artifacts.lookup(artifacts.kernel_key(kernel, {ARCH!r}, CALLING_CONVENTION))
assert found is not None, artifacts.manifests()
assert str(found.library).startswith(sys.argv[1]), found.library
assert [p.name for p in found.signature] == [p.name for p in kernel.signature()]
print(toy.source, module.build(8, "cpu").preset.hidden)
"""


def write_toy(folder: Path) -> Path:
    for name, text in TOY.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return folder


def repo_state() -> str:
    """The checkout's changes, untracked files included: what the toy must leave alone."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip("not a git checkout: cannot show that no repository file changed")
    return done.stdout


def run(env: dict[str, str], *args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def environment(**extra: str) -> dict[str, str]:
    sources = [str(ROOT / "packages" / name / "src") for name in ("mhc-core",)]
    path = os.pathsep.join([*sources, str(ROOT), *extra.pop("PYTHONPATH", "").split(os.pathsep)]).rstrip(os.pathsep)
    env = {key: value for key, value in os.environ.items() if key not in ("MHC_MODEL_PATH", "PYTHONPATH")}
    return env | {"PYTHONPATH": path, "MHC_PREBUILT": "1"} | extra


def test_a_third_model_is_one_package(tmp_path: Path) -> None:
    pytest.importorskip("cutlass", reason="compiling and exporting the toy's kernel needs the DSL")
    if shutil.which("cc") is None:
        pytest.skip("linking the exported kernel needs a C compiler (cc)")
    before = repo_state()
    toy = write_toy(tmp_path / "mhc-toy")
    env = environment(MHC_MODEL_PATH=str(toy), MHC_CACHE_DIR=str(tmp_path / "cache"))

    # Registered: the registry finds it beside the shipped models; an unknown key names it.
    listed = run(env, "-c", "from mhc_core import registry; print(sorted(registry.models()))")
    assert "'toy'" in listed, listed

    # codegen: the package's presets.toml renders into the package's presets/.
    out = run(env, "-m", "codegen")
    assert "mhc_toy/presets/h200_tp2_h1024.py" in out, out
    assert (toy / "src" / "mhc_toy" / "presets" / "__init__.py").is_file()
    assert "up to date" in run(env, "-m", "codegen", "--check")

    # compile_presets: ptxas's report, no spill, and a PTX digest keyed by the toy's preset.
    digest = tmp_path / "digest.json"
    out = run(env, "-m", "tools.compile_presets", "--model", "toy", "--ptx-digest", str(digest))
    assert f"toy.{PRESET} all_reduce {ARCH}" in json.loads(digest.read_text()), out

    # export_kernels: one library and manifest in the package's own kernels/ folder.
    run(env, "-m", "tools.export_kernels", "--model", "toy", "--arch", ARCH)
    kernels = toy / "src" / "mhc_toy" / "kernels" / ARCH
    assert (kernels / f"libmhc_toy_{ARCH}.so").is_file() and (kernels / "manifest.json").is_file()

    # The shipped-kernel lookup finds it there by its full key (its source hash covers mhc_toy).
    manifest = json.loads((kernels / "manifest.json").read_text())
    assert any(name.startswith("mhc_toy.") for name in manifest["sources"]), manifest["sources"]
    run(env, "-c", LOOKUP, str(toy))
    # The benchmarks run its suite by name.
    assert "toy" in run(env, "-c", "import benchmarks.run as run; print(run.SUITES)")
    assert repo_state() == before, "the toy changed files of the repository"

    # The wheel: its presets, kernels and entry point; installed, the entry point alone registers it.
    hatchling = pytest.importorskip("hatchling", reason="hatchling builds the wheel (nox -s tests installs it)")
    assert hatchling
    build = "import sys\nfrom hatchling.build import build_wheel\nprint(build_wheel(sys.argv[1]))\n"
    wheel = toy.parent / "dist"
    name = run(environment(PYTHONPATH=os.pathsep.join(sys.path)), "-c", build, str(wheel), cwd=toy).strip()
    with zipfile.ZipFile(wheel / name.splitlines()[-1]) as archive:
        names = archive.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "toy = mhc_toy.model:MODEL" in archive.read(entry_points).decode()
        archive.extractall(tmp_path / "site")
    assert f"mhc_toy/kernels/{ARCH}/libmhc_toy_{ARCH}.so" in names and "mhc_toy/presets/h200_tp2_h1024.py" in names
    installed = environment(PYTHONPATH=str(tmp_path / "site"), MHC_CACHE_DIR=str(tmp_path / "cache"))
    out = run(installed, "-c", LOOKUP, str(tmp_path / "site"))
    assert out.split()[0] == "None", out  # found through the installed entry point, not a folder
    assert repo_state() == before, "the toy changed files of the repository"


def test_an_out_of_tree_model_keeps_its_own_presets_file(tmp_path: Path) -> None:
    """Issue #48's second acceptance test: an out-of-tree model declares its own presets file
    (``Model.presets_file``), which codegen reads beside the repository's root presets.toml: a table
    added there renders into the model's own package. Its tables belong in that file: one put in the
    root presets.toml instead is refused, naming the file they go in. No DSL needed."""
    from tests.codegen.support import make_repository

    repository = make_repository(tmp_path / "repository")
    toy = write_toy(tmp_path / "mhc-toy")
    presets = toy / "presets.toml"
    table = '[toy.h200-tp4-h2048]\nhidden = 2048\ntp = 4\narchs = ["sm_90a"]\n'
    presets.write_text(presets.read_text() + "\n" + table)
    env = environment(MHC_MODEL_PATH=str(toy))
    env["PYTHONPATH"] = os.pathsep.join([str(repository / "packages" / "mhc-core" / "src"), str(repository)])
    out = run(env, "-m", "codegen", cwd=repository)
    module = toy / "src" / "mhc_toy" / "presets" / "h200_tp4_h2048.py"
    assert module.is_file(), out
    assert module.read_text().splitlines()[1].startswith("# in presets.toml. Do not edit"), module.read_text()
    assert not list((repository / "packages").glob("*/src/*/presets/h200_tp4_h2048.py"))
    assert "up to date" in run(env, "-m", "codegen", "--check", cwd=repository)

    root = repository / "presets.toml"
    root.write_text(root.read_text() + "\n" + table.replace("h2048]", "h2048-copy]"))
    done = subprocess.run([sys.executable, "-m", "codegen"], cwd=repository, env=env, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: presets.toml: [toy] toy ships its own presets file: its tables go there ({presets})",
        "nothing was written",
    ]
