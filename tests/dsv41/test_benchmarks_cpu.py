"""DSV4.1's benchmark suites (``mhc_dsv41.bench``) without a GPU: the geometry suite builds every
variant with options the op accepts (its ``ONE_TOKEN_ONLY`` was once past the op's bound, found on
the H200 when the suite first ran from its package)."""

from __future__ import annotations

import pytest


class _Built(Exception):
    """Raised by the stand-in op once the suite has handed it a variant's options."""


def test_geometry_suite_builds_every_variant_with_valid_options(monkeypatch) -> None:
    from mhc_core.bench.records import Context
    from mhc_core.host.calls.validation import INT32_MAX, check_int
    from mhc_core.host.op import MAX_NUM_TOKENS
    from mhc_dsv41 import AllReduceMHC
    from mhc_dsv41.bench import suites

    seen = []

    def from_config(config, *, max_num_tokens, device, group, persistent_min_tokens, clusters, staged_tokens):
        # The bounds ``AllReduceMHC._build`` checks, through the same function.
        check_int("persistent_min_tokens", persistent_min_tokens, minimum=1, maximum=MAX_NUM_TOKENS)
        if clusters is not None:
            check_int("clusters", clusters, minimum=1, maximum=INT32_MAX)
        check_int("staged_tokens", staged_tokens, minimum=2, maximum=4)
        seen.append((config.cluster_size, config.threads, persistent_min_tokens))
        raise _Built

    monkeypatch.setattr(AllReduceMHC, "from_config", staticmethod(from_config))
    ctx = Context(tp=1, rank=0, group=None, bandwidth=1.0)
    geometries = suites.GEOMETRIES
    for index in range(len(geometries)):  # each variant first in turn: the stand-in stops the suite
        monkeypatch.setattr(suites, "GEOMETRIES", geometries[index:])
        with pytest.raises(_Built):
            suites.dsv41_geometry(ctx, [1])
    assert len(seen) == len(geometries) and seen[0][2] == suites.ONE_TOKEN_ONLY
