"""``mhc_core.entry_points.of_group``: the registry's fast read of installed entry points gives what
``importlib.metadata.entry_points(group=...)`` gives, on this interpreter's own ``sys.path`` and on
built layouts with the corners of that lookup (shadowing, zip archives, ``.egg-info`` files, a folder
where a file belongs, the working directory, another finder)."""

from __future__ import annotations

import importlib.metadata
import sys
import zipfile
from pathlib import Path

import pytest

from mhc_core import entry_points, registry

GROUP = registry.GROUP


def _key(entry: importlib.metadata.EntryPoint) -> tuple[str, str, str, str]:
    return (entry.name, entry.value, entry.group, entry.dist.name if entry.dist else "?")


def _distribution(folder: Path, name: str, entry_points_text: str | None) -> Path:
    """A ``<name>-1.0.dist-info`` folder in ``folder`` (made if need be)."""
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    if entry_points_text is not None:
        (info / "entry_points.txt").write_text(entry_points_text)
    return info


def _declares(key: str) -> str:
    return f"[{GROUP}]\n{key} = pkg_{key}.model:MODEL\n\n[console_scripts]\n{key}-tool = pkg_{key}.cli:main\n"


@pytest.mark.parametrize("group", [GROUP, "console_scripts", "pytest11"])
def test_this_interpreter_answers_as_importlib_metadata(group: str) -> None:
    ours = sorted(map(_key, entry_points.of_group(group)))
    assert ours == sorted(map(_key, importlib.metadata.entry_points(group=group)))


class _OtherFinder:
    """A finder other than the path finder that yields distributions (as a plugin system's might)."""

    def __init__(self, info: Path) -> None:
        self.info = info

    def find_spec(self, *args: object) -> None:
        return None

    def find_distributions(self, context: importlib.metadata.DistributionFinder.Context) -> list:
        return [importlib.metadata.PathDistribution(self.info)]


def test_built_layouts_answer_as_importlib_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second, cwd, elsewhere = (tmp_path / name for name in ("first", "second", "cwd", "elsewhere"))
    # "toy" in `first` declares nothing and shadows the "Toy" of `second`, which does
    _distribution(first, "toy", None)
    _distribution(second, "Toy", _declares("shadowed"))
    _distribution(second, "other.pkg", _declares("other"))
    # names the group, but only in a value of another section: read, and nothing selected
    _distribution(second, "mentions", "[console_scripts]\nx = mhc_kernels.models:main\n")
    (second / "old.egg-info").write_text("Metadata-Version: 1.0\nName: old\n")  # a file, not a folder
    (_distribution(second, "folded", None) / "entry_points.txt").mkdir()  # a folder where the file belongs
    _distribution(cwd, "here", _declares("here"))
    _distribution(elsewhere / "a", "other_pkg", _declares("found_by_another_finder"))
    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("zipped-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: zipped\nVersion: 1.0\n")
        zipped.writestr("zipped-1.0.dist-info/entry_points.txt", _declares("zipped"))

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "path", [str(first), str(second), "", str(archive), str(tmp_path / "missing")])
    assert sorted(map(_key, entry_points.of_group(GROUP))) == sorted(
        map(_key, importlib.metadata.entry_points(group=GROUP))
    )
    assert sorted(entry.name for entry in entry_points.of_group(GROUP)) == ["here", "other", "zipped"]

    # another finder ahead of the path finder: its "other_pkg" shadows the one in `second`
    monkeypatch.setattr(sys, "meta_path", [_OtherFinder(elsewhere / "a" / "other_pkg-1.0.dist-info"), *sys.meta_path])
    ours = sorted(map(_key, entry_points.of_group(GROUP)))
    assert ours == sorted(map(_key, importlib.metadata.entry_points(group=GROUP)))
    assert [key[0] for key in ours] == ["found_by_another_finder", "here", "zipped"]
