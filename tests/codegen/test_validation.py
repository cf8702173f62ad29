"""A bad preset stops codegen before anything is written, with a message naming file, table, key, rule and value.

Each case changes one key of a real table (a copy of the models' presets files, in one file) and also
changes a good table's description, so a run that wrote anything would show it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from codegen import main
from tests.codegen.support import OUTPUT_DIRS, make_root, repo_presets, snapshot, write_presets

DSV = "dsv41.gb300-tp4-h5120"  # explicit geometry: hidden 5120, hc 4, tp 4, 5 x 128 threads, 1 lane
DSV_DEFAULTS = "dsv41.h200-tp4-h5120"  # geometry left to default_geometry
GLM = "glm5.h200-tp4-h4096"  # hidden 4096, tp 4, cluster 8 (256 threads)
DELETE = object()

ARCHS = "('sm_90a', 'sm_100a', 'sm_103a')"
DSV_KEYS = (
    "hidden, hc, tp, top_k, cluster_size, threads, rank_lanes, norm_eps, archs, publish_threads, tuned, "
    "layer_input_format, layer_input_bf16, two_shot_min_tokens, description"
)
GLM_KEYS = (
    "hidden, hc, tp, top_k, cluster_size, cluster_tokens, rms_eps, hc_eps, post_mult, sinkhorn_repeat, "
    "norm_eps, archs, publish_threads, mixes_threads, persistent_min_tokens, tuned, layer_input_format, "
    "layer_input_bf16, two_shot_min_tokens, description, threads (derived)"
)

#: The rule of a float the kernels compute with in FP32 (``mhc_core.presets.require_positive_float``).
POSITIVE_FP32 = "must be a finite number > 0 in FP32's normal range [1.17549435e-38, 3.40282347e+38]"

# (preset, changed keys, message after "presets.toml: [preset] ")
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    # ------------------------------------------------------------------ DSV4.1
    "dsv-hidden-multiple-of-8": (
        DSV,
        {"hidden": 5124},
        "key 'hidden': must be a multiple of 8 (16-byte fragments); got 5124",
    ),
    "dsv-hidden-defaulted-geometry": (
        DSV_DEFAULTS,
        {"hidden": 5124},
        "key 'hidden': must be a multiple of 8 (16-byte fragments); got 5124",
    ),
    "dsv-tp-allowed": (DSV, {"tp": 3}, "key 'tp': must be one of (1, 2, 4, 8); got 3"),
    "dsv-rank-lanes-allowed": (DSV, {"rank_lanes": 3}, "key 'rank_lanes': must be 1, 2, 4 or 8; got 3"),
    "dsv-rank-lanes-divide-tp": (DSV, {"rank_lanes": 8}, "key 'rank_lanes': must divide tp (4); got 8"),
    "dsv-threads-multiple-of-32": (
        DSV,
        {"threads": 100},
        "key 'threads': must be a multiple of 32 (whole warps); got 100",
    ),
    "dsv-threads-at-most-1024": (DSV, {"threads": 2048}, "key 'threads': must be <= 1024; got 2048"),
    "dsv-publish-threads-multiple-of-32": (
        DSV,
        {"publish_threads": 96 + 16},
        "key 'publish_threads': must be a multiple of 32 (whole warps); got 112",
    ),
    "dsv-trips-times-hc": (
        DSV,
        {"hidden": 7168, "hc": 16},
        "key 'cluster_size': trips x hc must be <= 16 (each trip stages hc residual fragments in shared memory); "
        "trips = 2, hc = 16; got 5",
    ),
    "dsv-archs-unknown": (
        DSV,
        {"archs": ["sm_103a", "sm_80"]},
        f"key 'archs': must be among {ARCHS}; got ('sm_103a', 'sm_80')",
    ),
    "dsv-archs-empty": (DSV, {"archs": []}, "key 'archs': must be a non-empty list of arch names; got ()"),
    "dsv-eps-zero": (DSV, {"norm_eps": 0.0}, f"key 'norm_eps': {POSITIVE_FP32}; got 0.0"),
    "dsv-eps-negative": (DSV, {"norm_eps": -1e-6}, f"key 'norm_eps': {POSITIVE_FP32}; got -1e-06"),
    "dsv-crossover-zero": (DSV, {"two_shot_min_tokens": 0}, "key 'two_shot_min_tokens': must be >= 1; got 0"),
    "dsv-unknown-key": (
        DSV,
        {"rank_lane": 2},
        f"key 'rank_lane': is not a DSV41Preset key (expected one of {DSV_KEYS}); got 2",
    ),
    "dsv-name-is-not-a-key": (DSV, {"name": "x"}, "key 'name': is the table name, not a key; got 'x'"),
    "dsv-missing-key": (DSV, {"top_k": DELETE}, "key 'top_k': is required; missing"),
    "dsv-integer-type": (DSV, {"tp": "4"}, "key 'tp': must be one of (1, 2, 4, 8); got '4'"),
    "dsv-description-type": (DSV, {"description": 5}, "key 'description': must be a string; got 5"),
    # ------------------------------------------------------------------- GLM-5
    "glm-hidden-multiple-of-8": (
        GLM,
        {"hidden": 4100},
        "key 'hidden': must be a multiple of 8 (16-byte fragments); got 4100",
    ),
    "glm-tp-allowed": (GLM, {"tp": 6}, "key 'tp': must be one of (1, 2, 4, 8); got 6"),
    "glm-hc-four": (
        GLM,
        {"hc": 8},
        "key 'hc': must be 4 (one lane per residual stream in the GLM kernels); got 8",
    ),
    "glm-fragments-divisible-by-cluster": (
        GLM,
        {"cluster_size": 3},
        "key 'cluster_size': must divide the 512 fragments of hidden = 4096 evenly; got 3",
    ),
    "glm-threads-multiple-of-32": (
        GLM,
        {"hidden": 4160},  # 520 fragments / 8 = 65 groups = 260 threads
        "key 'cluster_size': threads = hidden / 8 / cluster_size * 4 = 260 must be a multiple of 32 and <= 1024; got 8",
    ),
    "glm-threads-at-most-1024": (
        GLM,
        {"cluster_size": 1},  # 512 groups = 2048 threads
        "key 'cluster_size': threads = hidden / 8 / cluster_size * 4 = 2048 must be a multiple of 32 and <= 1024; "
        "got 1",
    ),
    "glm-threads-25-per-peer": (
        GLM,
        {"hidden": 1024},  # 128 fragments / 8 = 16 groups = 64 threads < 25 x 8
        "key 'cluster_size': threads = 64 must be >= 25 x cluster_size (one thread per reduced value and peer); got 8",
    ),
    "glm-cluster-tokens-malformed": (
        GLM,
        {"cluster_tokens": [[64]]},
        "key 'cluster_tokens': each entry must be a [min_tokens, tokens_per_cluster] pair of integers; got (64,)",
    ),
    "glm-cluster-tokens-not-a-list": (
        GLM,
        {"cluster_tokens": 4},
        "key 'cluster_tokens': must be a list of [min_tokens, tokens_per_cluster] pairs; got 4",
    ),
    "glm-cluster-tokens-unsorted": (
        GLM,
        {"cluster_tokens": [[256, 8], [64, 4]]},
        "key 'cluster_tokens': min_tokens must be strictly increasing; got ((256, 8), (64, 4))",
    ),
    "glm-cluster-tokens-threshold": (
        GLM,
        {"cluster_tokens": [[0, 4]]},
        "key 'cluster_tokens': min_tokens must be >= 1; got (0, 4)",
    ),
    "glm-persistent-negative": (
        GLM,
        {"persistent_min_tokens": -1},
        "key 'persistent_min_tokens': must be >= 0; got -1",
    ),
    "glm-persistent-below-thresholds": (
        GLM,
        {"persistent_min_tokens": 64},
        "key 'persistent_min_tokens': must be above every cluster_tokens threshold (the last is 128), or 0; got 64",
    ),
    "glm-archs-unknown": (GLM, {"archs": ["sm_89"]}, f"key 'archs': must be among {ARCHS}; got ('sm_89',)"),
    "glm-archs-repeated": (
        GLM,
        {"archs": ["sm_90a", "sm_90a"]},
        "key 'archs': must not repeat an arch; got ('sm_90a', 'sm_90a')",
    ),
    "glm-rms-eps-not-positive": (GLM, {"rms_eps": 0.0}, f"key 'rms_eps': {POSITIVE_FP32}; got 0.0"),
    "glm-hc-eps-not-positive": (GLM, {"hc_eps": -1e-6}, f"key 'hc_eps': {POSITIVE_FP32}; got -1e-06"),
    "glm-norm-eps-not-positive": (GLM, {"norm_eps": 0}, f"key 'norm_eps': {POSITIVE_FP32}; got 0"),
    "glm-post-mult-not-positive": (
        GLM,
        {"post_mult": -2.0},
        f"key 'post_mult': {POSITIVE_FP32}; got -2.0",
    ),
    "glm-sinkhorn-repeat": (GLM, {"sinkhorn_repeat": 0}, "key 'sinkhorn_repeat': must be >= 1; got 0"),
    "glm-mixes-threads": (
        GLM,
        {"mixes_threads": 48},
        "key 'mixes_threads': must be a multiple of 32 (whole warps); got 48",
    ),
    "glm-unknown-key": (
        GLM,
        {"sinkhorn_iters": 20},
        f"key 'sinkhorn_iters': is not a GLM5Preset key (expected one of {GLM_KEYS}); got 20",
    ),
    "glm-missing-key": (GLM, {"cluster_tokens": DELETE}, "key 'cluster_tokens': is required; missing"),
}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary working directory holding a copy of the generated tree (``root``)."""
    monkeypatch.chdir(tmp_path)
    make_root(tmp_path / "root")
    return tmp_path


def run_bad(workdir: Path, document: dict, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run codegen on ``document``; assert it failed and wrote nothing; return its error lines."""
    # A good change elsewhere: a run that wrote anything would rewrite this preset's module.
    document["dsv41"]["h200-tp1-h5120"]["description"] = "changed: must not reach the generated module"
    presets = write_presets(workdir / "presets.toml", document)
    root = workdir / "root"
    before = snapshot(root)
    code = main(["--presets", str(presets), "--root", str(root)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert snapshot(root) == before, "codegen wrote files despite a bad preset"
    lines = err.splitlines()
    assert lines[-1] == "nothing was written"
    return lines[:-1]


def apply(document: dict, section: str, changes: dict[str, Any]) -> None:
    model, name = section.split(".", 1)
    table = document[model][name]
    for key, value in changes.items():
        if value is DELETE:
            del table[key]
        else:
            table[key] = value


@pytest.mark.parametrize("case", CASES)
def test_rule(case: str, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    section, changes, message = CASES[case]
    document = repo_presets()
    apply(document, section, changes)
    assert run_bad(workdir, document, capsys) == [f"error: presets.toml: [{section}] {message}"]


# --------------------------------------- issue #48: names, derived values, the key at fault

#: A new table whose name encodes GPU, tp and hidden: ``[dsv41.h200-tp4-h6144]``.
NAMED = "dsv41.h200-tp4-h6144"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tp": 8}, "key 'tp': the name says tp4: tp = 4; got 8"),
        ({"hidden": 6000}, "key 'hidden': the name says h6144: hidden = 6144; got 6000"),
        ({"archs": ["sm_100a"]}, "key 'archs': the name's GPU (h200) runs sm_90a, which must be among archs; "
         "got ('sm_100a',)"),
    ],
    ids=["tp", "hidden", "archs"],
)  # fmt: skip
def test_name_agrees_with_its_fields(
    changes: dict[str, Any], message: str, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A table's name states its target; a key that contradicts it is refused, naming that key."""
    document = repo_presets()
    model, name = NAMED.split(".")
    document[model][name] = {**document["dsv41"]["h200-tp4-h5120"], "hidden": 6144, **changes}
    assert run_bad(workdir, document, capsys) == [f"error: presets.toml: [{NAMED}] {message}"]


def test_hc_in_a_name(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = repo_presets()
    apply(document, "dsv41.test-hc8-h5120", {"hc": 4})
    assert run_bad(workdir, document, capsys) == [
        "error: presets.toml: [dsv41.test-hc8-h5120] key 'hc': the name says hc8: hc = 8; got 4"
    ]


def test_a_bad_hidden_is_blamed_on_hidden(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """hidden 100000 in a table that leaves the geometry to default_geometry: the rule the derived
    cluster_size breaks is hidden's fault (the table never wrote cluster_size)."""
    document = repo_presets()
    apply(document, DSV_DEFAULTS, {"hidden": 100000})
    [line] = run_bad(workdir, document, capsys)
    assert line == (
        f"error: presets.toml: [{DSV_DEFAULTS}] key 'hidden': the geometry default_geometry(hidden, hc, tp) "
        "derives for it (cluster_size = 8, threads = 128, rank_lanes = 1; not in the presets file) breaks a rule "
        "of 'cluster_size': trips x hc must be <= 16 (each trip stages hc residual fragments in shared memory); "
        "trips = 13, hc = 4; write cluster_size, threads and rank_lanes to choose one; got 100000"
    )


def test_glm_threads_written_must_agree(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GLM's threads is derived (hidden / 8 / cluster_size * 4): a table may write it; a value the
    kernels would not launch with is refused with codegen's usual error, naming threads."""
    document = repo_presets()
    apply(document, GLM, {"threads": 512})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'threads': is derived: hidden / 8 / cluster_size * 4 = 256 for this "
        "table; write that or leave it out; got 512"
    ]


def test_derived_values_written_are_shown_with_their_origin(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every key the design card names (hidden, hc, tp, top_k, cluster size, threads) works in both
    models' tables; the generated module says where each derived value came from."""
    document = repo_presets()
    apply(document, GLM, {"threads": 256})
    assert {"hidden", "hc", "tp", "top_k", "cluster_size", "threads"} <= set(document["glm5"]["h200-tp4-h4096"])
    assert {"hidden", "hc", "tp", "top_k", "cluster_size", "threads"} <= set(document["dsv41"]["gb300-tp4-h5120"])
    presets = write_presets(workdir / "presets.toml", document)
    assert main(["--presets", str(presets), "--root", str(workdir / "root")]) == 0, capsys.readouterr().err
    module = (workdir / "root" / OUTPUT_DIRS["glm5"] / "h200_tp4_h4096.py").read_text()
    assert "\n# threads = 256: derived, hidden / 8 / cluster_size * 4 (written in presets.toml, checked)\n" in module
    defaulted = (workdir / "root" / OUTPUT_DIRS["dsv41"] / "h200_tp4_h5120.py").read_text()
    assert "    cluster_size=5,  # not in presets.toml: default_geometry(hidden, hc, tp)\n" in defaulted


def test_grouped_shared_memory_rule(workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """The grouped kernels' shared-memory rule. Today's token limits keep every preset within it;
    with 32 tokens on tensor cores allowed, hidden 6144 stages too much."""
    import mhc_glm5.config
    from mhc_glm5.config import mma_shared_bytes

    monkeypatch.setattr(mhc_glm5.config, "MMA_TOKENS", (8, 16, 32))
    monkeypatch.setattr(mhc_glm5.config, "GROUPED_MAX_THREADS", 1024)
    document = repo_presets()
    apply(document, GLM, {"hidden": 6144, "cluster_tokens": [[64, 4], [256, 32]]})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'cluster_tokens': 32 tokens per cluster need "
        f"{mma_shared_bytes(6144, 8, 32)} bytes of shared memory, more than 232448; got 32"
    ]


def test_one_token_shared_memory_rule(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The one-token kernel stages 96 chunks of its fn columns: hidden 10240 on 8 CTAs is too much."""
    from mhc_glm5.config import boundary_shared_bytes

    document = repo_presets()
    apply(document, GLM, {"hidden": 10240, "cluster_tokens": [[16, 2]]})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'cluster_size': the one-token kernel stages its fn slice in shared "
        f"memory: {boundary_shared_bytes(10240, 8)} bytes, more than 232448 (raise cluster_size); got 8"
    ]


def test_persistent_shared_memory_rule(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The persistent boundary double-buffers its groups beside the staged fn: hidden 8192 on 8
    CTAs is too much for it (the one-token and 2-token kernels still fit)."""
    from mhc_glm5.config import persistent_shared_bytes

    document = repo_presets()
    apply(document, GLM, {"hidden": 8192, "cluster_tokens": [[16, 2]], "persistent_min_tokens": 256})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'persistent_min_tokens': the persistent boundary does not fit: its "
        f"buffered groups need {persistent_shared_bytes(8192, 8)} bytes of shared memory, more than "
        "232448; use 0; got 256"
    ]


def test_tensor_core_threads_rule(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tensor-core kernel runs a warp per 4 fragments: 1024 threads elsewhere become 2048."""
    document = repo_presets()
    apply(document, GLM, {"hidden": 8192, "cluster_size": 4, "cluster_tokens": [[64, 8]]})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'cluster_tokens': 8 tokens per cluster use the tensor-core kernel, "
        "one warp per 4 fragments: 2048 threads > 1024 (raise cluster_size); got 8"
    ]


def test_grouped_register_rule(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """hidden 4608 on 8 CTAs is 288 threads: 4 tokens per cluster would spill registers."""
    document = repo_presets()
    apply(document, GLM, {"hidden": 4608, "cluster_tokens": [[16, 2], [32, 4]]})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'cluster_tokens': more than 2 tokens per cluster need threads <= 256 "
        "(above that ptxas spills the grouped kernel's registers); threads = 288; got 4"
    ]


@pytest.mark.parametrize("tokens", (5, 17))
def test_tokens_per_cluster_limit(tokens: int, workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = repo_presets()
    apply(document, GLM, {"cluster_tokens": [[64, 4], [256, tokens]]})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{GLM}] key 'cluster_tokens': tokens_per_cluster must be in 1..4 (CUDA-core GEMV) "
        f"or one of (8, 16) (tensor cores); got (256, {tokens})"
    ]


def test_unknown_model(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = repo_presets()
    document["llama3"] = {"h200-tp2-h4096": dict(document["glm5"]["h200-tp2-h4096"])}
    assert run_bad(workdir, document, capsys) == [
        "error: presets.toml: [llama3] unknown model: no registered package declares 'llama3'; "
        "expected one of dsv41, glm5"
    ]


def test_preset_not_a_table(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    presets = workdir / "presets.toml"
    presets.write_text("dsv41.bad = 3\n", encoding="utf-8")
    before = snapshot(workdir / "root")
    code = main(["--presets", str(presets), "--root", str(workdir / "root")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "error: presets.toml: [dsv41.bad] must be a table of preset keys; got 3",
        "nothing was written",
    ]
    assert snapshot(workdir / "root") == before


def test_bad_name(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = repo_presets()
    document["dsv41"]["h200_tp2"] = document["dsv41"].pop("h200-tp2-h5120")
    assert run_bad(workdir, document, capsys) == [
        "error: presets.toml: [dsv41.h200_tp2] key 'name': must be letters, digits and '-', starting with a letter; "
        "got 'h200_tp2'"
    ]


def test_every_bad_table_is_reported(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = repo_presets()
    apply(document, DSV, {"rank_lanes": 3})
    apply(document, GLM, {"cluster_size": 3})
    assert run_bad(workdir, document, capsys) == [
        f"error: presets.toml: [{DSV}] key 'rank_lanes': must be 1, 2, 4 or 8; got 3",
        f"error: presets.toml: [{GLM}] key 'cluster_size': must divide the 512 fragments of hidden = 4096 evenly; "
        "got 3",
    ]


def test_invalid_toml(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    presets = workdir / "presets.toml"
    presets.write_text("[dsv41.x]\nhidden = \n", encoding="utf-8")
    code = main(["--presets", str(presets), "--root", str(workdir / "root")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: presets.toml: invalid TOML: ")


def test_threads_multiple_of_rank_lanes_is_implied() -> None:
    """The 'threads multiple of rank_lanes' rule cannot fail on its own: every allowed rank_lanes divides 32."""
    from mhc_core.presets import PresetError, require_threads

    for lanes in (1, 2, 4, 8):
        assert 32 % lanes == 0
    with pytest.raises(PresetError) as raised:
        require_threads("threads", 96, multiple=64)
    assert str(raised.value) == "key 'threads': must be a multiple of 64; got 96"
