"""A construction every rank agrees on, before any collective step.

Building an op is collective: every rank allocates a mailbox its peers map, then warms up with
them. A rank that fails on its own (a bad argument, a compile error, out of memory) or that was
built with another configuration must not leave its peers waiting in an allocation or a
rendezvous it will never reach, nor let them compute peer offsets from another capacity.

So construction is a sequence of votes over the group (``Startup.vote``: one ``all_gather_object``
of a ``Ballot`` per stage), each before the step it guards:

1. ``config``, once every argument is validated locally and before the device is touched: the op,
   model, hidden, hc, capacity, top_k, transport, allocation, spin bound, geometry and the
   packages' versions;
2. ``kernels``, once every kernel is loaded or compiled and the mailbox is known to fit, before
   any allocation: the arch and every kernel's full key (facts beside it: each rank's GPU, which
   picks the allocation);
3. the allocation's own exchanges (``mhc_core.host.ranks.allocation``), then ``mapped``, once every peer's
   mailbox is mapped and the call programs are bound, before the warm-up;
4. ``ready``, after the warm-up: every rank's kernels launched once and no spin timed out. A rank
   whose warm-up failed casts its error in this vote; a process group's warm-up has a short spin
   bound of its own (``mhc_core.host.op.WARMUP_SPIN_TIMEOUT_MS``), so the peers of a rank that
   failed after ``mapped`` stop waiting for its publishes within seconds and name it.

Any difference in a fingerprint raises ``StartupError`` (a ``ValueError``) on every rank, naming
the fields and which ranks hold which value. A rank that fails locally casts its failure in the
next vote instead of a fingerprint (``construction`` does that for any exception, so the failing
rank still reaches the vote its peers wait in); every peer then raises ``StartupError`` naming it
and its error. Loopback ranks (one process) compare their ``config`` and ``kernels`` fingerprints
with the ranks of the same instance built before them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

LOG = logging.getLogger("mhc")

STAGES = ("config", "kernels", "mapped", "ready")


class StartupError(ValueError):
    """Ranks could not agree on building an op: a rank failed, or their configurations differ.

    ``ranks``: the ranks that failed or that hold a value other than rank 0's; ``fields``: field ->
    {rank: value} for every field that differs (empty when a rank failed)."""

    def __init__(self, message: str, *, ranks: tuple[int, ...], fields: dict[str, dict[int, Any]]) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.fields = fields


@dataclass
class Ballot:
    """One rank's vote at one stage: its fingerprint (compared) and facts (not compared), or the
    error that stopped it."""

    rank: int
    stage: str
    fingerprint: dict[str, Any] = field(default_factory=dict)
    facts: Any = None
    error: str | None = None


def flatten(fingerprint: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys, so a difference names the innermost field."""
    flat: dict[str, Any] = {}
    for key, value in fingerprint.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def differences(ballots: list[Ballot]) -> dict[str, dict[int, Any]]:
    """Every fingerprint field whose value is not the same on every rank: field -> {rank: value}."""
    flat = {ballot.rank: flatten(ballot.fingerprint) for ballot in ballots}
    names = sorted({name for fields in flat.values() for name in fields})
    missing = "<absent>"
    found = {}
    for name in names:
        values = {rank: fields.get(name, missing) for rank, fields in flat.items()}
        if len({repr(value) for value in values.values()}) > 1:
            found[name] = values
    return found


def describe_values(values: dict[int, Any]) -> str:
    """``ranks [0, 2] = 64, rank 1 = 128``: the ranks grouped by the value they hold."""
    groups: dict[str, list[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(repr(value), []).append(rank)
    parts = []
    for value, ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        parts.append(f"{who} = {value}")
    return ", ".join(parts)


def check_ballots(ballots: list[Ballot], rank: int, what: str) -> None:
    """Raise ``StartupError`` if any rank failed, or their stages or fingerprints differ."""
    failed = [ballot for ballot in ballots if ballot.error is not None]
    if failed:
        reasons = "; ".join(f"rank {ballot.rank}: {ballot.error}" for ballot in failed)
        raise StartupError(
            f"rank {rank}: building {what} failed on another rank, so no rank goes on ({reasons})",
            ranks=tuple(ballot.rank for ballot in failed),
            fields={},
        )
    stages = {ballot.rank: ballot.stage for ballot in ballots}
    if len(set(stages.values())) > 1:
        raise StartupError(
            f"rank {rank}: building {what}: the ranks are at different startup stages ({describe_values(stages)}): "
            "every rank must build the same ops in the same order",
            ranks=tuple(sorted(stages)),
            fields={"stage": stages},
        )
    differing = differences(ballots)
    if differing:
        listed = "; ".join(f"{name}: {describe_values(values)}" for name, values in differing.items())
        reference = {ballot.rank: flatten(ballot.fingerprint) for ballot in ballots}
        first = min(reference)
        ranks = sorted(
            {r for values in differing.values() for r, v in values.items() if repr(v) != repr(values.get(first))}
        )
        raise StartupError(
            f"rank {rank}: the ranks were asked to build {what} with different configurations ({listed}); "
            "nothing was allocated: build the same op on every rank",
            ranks=tuple(ranks),
            fields=differing,
        )


class Startup:
    """The votes of one op's construction over its group (see the module docstring)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.what = "the op"
        self.finished = False
        self._next = 0

    def vote(
        self,
        stage: str,
        fingerprint: dict[str, Any],
        facts: Any = None,
        device: Any = None,
        error: BaseException | None = None,
    ) -> list[Any]:
        """Exchange this rank's ``fingerprint`` for ``stage``; every rank's facts, in rank order.
        Raises ``StartupError`` on every rank if any rank failed or any fingerprint differs.
        ``error``: this rank failed at this stage; cast it, so that every rank's ``StartupError``
        names it (this rank's too, chained to ``error``)."""
        described = None if error is None else f"{type(error).__name__}: {error}"
        ballot = Ballot(self.group.rank, stage, fingerprint, facts, described)
        self._next += 1
        try:
            ballots = self.group.exchange_ballots(ballot, device)
            check_ballots(ballots, self.group.rank, self.what)
        except BaseException as failure:
            self.finished = True  # a raising vote raised on every rank: nobody waits for another
            if error is not None and failure.__cause__ is None:
                raise failure from error
            raise
        return [ballot.facts for ballot in sorted(ballots, key=lambda b: b.rank)]

    def fail(self, error: BaseException, device: Any = None) -> None:
        """Cast ``error`` in the vote the peers wait in (once), so none of them waits for this rank."""
        if self.finished:
            return
        self.finished = True
        ballot = Ballot(self.group.rank, "failed", error=f"{type(error).__name__}: {error}")
        try:
            self.group.exchange_ballots(ballot, device)
        except Exception as failure:  # the group itself is broken: the original error is what matters
            LOG.warning("rank %d: could not tell the peers that construction failed: %s", self.group.rank, failure)

    def end(self) -> None:
        self.finished = True


def package_versions(module: str) -> dict[str, str]:
    """torch's, mhc-core's and the op's model package's versions (``module``: the op's module)."""
    import importlib

    import torch

    from ...version import __version__

    versions = {"torch": str(torch.__version__), "mhc_core": __version__}
    package = module.partition(".")[0]
    if package != "mhc_core":
        versions[package] = str(getattr(importlib.import_module(package), "__version__", "unknown"))
    return versions


_ACTIVE = threading.local()


def active() -> Startup | None:
    """The startup of the construction running on this thread, if any."""
    return getattr(_ACTIVE, "startup", None)


@contextlib.contextmanager
def construction(group: Any, what: str, device: Any = None) -> Iterator[Startup]:
    """The outermost construction on this thread owns a ``Startup`` over ``group``; nested ones (a
    ``from_preset`` building through ``__init__``) share it. Any exception casts a failure vote."""
    outer = active()
    if outer is not None:
        yield outer
        return
    from .groups import resolve_group

    startup = Startup(resolve_group(group))
    startup.what = what
    _ACTIVE.startup = startup
    try:
        yield startup
    except BaseException as error:
        startup.fail(error, device)
        raise
    finally:
        _ACTIVE.startup = None
        startup.end()


F = TypeVar("F", bound=Callable[..., Any])


def collective(function: F) -> F:
    """Run an op's constructor (``__init__``, ``from_config``, ``from_preset``) inside
    ``construction`` over its ``group`` keyword, so a failure anywhere in it reaches the peers."""

    @functools.wraps(function)
    def wrapper(first: Any, *args: Any, **kwargs: Any) -> Any:
        owner = first if isinstance(first, type) else type(first)
        with construction(kwargs.get("group"), owner.__name__, kwargs.get("device")):
            return function(first, *args, **kwargs)

    return wrapper  # type: ignore[return-value]
