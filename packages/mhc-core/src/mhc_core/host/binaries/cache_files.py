"""Files in the on-disk cache that eight ranks and a shared machine can trust.

The cache (``MHC_CACHE_DIR``, else the user's cache folder) holds libraries this process will
``dlopen``: whoever can write a file there runs code as the user. So every folder from the cache
root down is created private (0700) and, before it is used, must be a real directory (not a
symbolic link) owned by this user and writable by nobody else; every file read from it likewise,
opened without following a symbolic link. The folders above the root must not let anyone else
swap the cache for another: none may be owned by another user (root aside) or writable by others
without the sticky bit (``/tmp`` is fine); missing ones are created 0700, whatever the umask. A
library's size and sha256 are recorded beside it when it is written and compared, on the very
descriptor that is loaded (``mhc_core.host.binaries.verified``), before ``dlopen`` maps it (a truncated
library mapped by ``dlopen`` is a SIGBUS, not an exception). Files are written under a unique
temporary name and renamed into place, so a reader sees a whole file or none, and a lock file per
entry (``flock``) lets concurrent processes build it once: the others wait, then load it. The
holder writes its pid into the lock; a waiter says once whom it waits for, and gives up after
``MHC_CACHE_LOCK_TIMEOUT_S`` (then it builds for itself without persisting). Scratch folders carry
their process's pid: those of a process that died (SIGKILL mid-write) are removed the next time
one is made there. A folder planted where a file is written is moved aside, with one warning.

``UnsafeCache`` carries the path and the reason; the callers warn once per file and process
(``warn_once``) and then do without the cache: compile, build or (where nothing can) raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import logging
import math
import os
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOG = logging.getLogger("mhc")
#: Opening a file never follows a symbolic link, nor blocks on a FIFO planted in its place.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_warned: set[tuple[str, str]] = set()


class UnsafeCache(Exception):
    """A cache path that must not be used, and why."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = Path(path)
        self.reason = reason


def warn_once(what: str, path: Path | str, reason: str) -> None:
    """``could not use <what> <path>: <reason>``, once per process and file (a rank looks at an
    entry twice: before and after waiting for its lock)."""
    if (str(path), reason) in _warned:
        return
    _warned.add((str(path), reason))
    LOG.warning("could not use %s %s: %s", what, path, reason)


def check_owned(path: Path, status: os.stat_result, *, directory: bool) -> None:
    """Raise ``UnsafeCache`` unless ``status`` (an ``lstat``) is a directory or regular file owned by
    this user that nobody else can write."""
    if stat.S_ISLNK(status.st_mode):
        raise UnsafeCache(path, "it is a symbolic link (not followed)")
    if directory and not stat.S_ISDIR(status.st_mode):
        raise UnsafeCache(path, "it is not a directory")
    if not directory and not stat.S_ISREG(status.st_mode):
        raise UnsafeCache(path, "it is not a regular file")
    if status.st_uid != os.geteuid():
        raise UnsafeCache(path, f"it is owned by uid {status.st_uid}, not by this user (uid {os.geteuid()})")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(status.st_mode)
        raise UnsafeCache(path, f"it is writable by its group or others (mode {mode:o}; chmod go-w it, or remove it)")


def check_ancestors(root: Path) -> None:
    """Raise ``UnsafeCache`` for a folder above ``root`` through which someone else could swap the
    cache: owned by another user (root aside), or writable by others without the sticky bit. Both
    the path as written and where its links lead are checked; missing folders end the walk (they
    are created 0700). Group-writable folders are accepted: many hosts give each user a group of
    their own."""
    absolute = Path(os.path.abspath(root))
    folders = []
    for folder in reversed(absolute.parents):  # "/" first
        if not os.path.lexists(folder):
            break
        folders.append(folder)
    if folders:
        real = Path(os.path.realpath(folders[-1]))
        folders += [*reversed(real.parents), real]
    for folder in dict.fromkeys(folders):
        status = os.stat(folder)  # a link: what it leads to (the link itself is its folder's to change)
        mode = stat.S_IMODE(status.st_mode)
        if status.st_uid not in (0, os.geteuid()):
            raise UnsafeCache(
                folder, f"a folder above the cache is owned by uid {status.st_uid}, not by this user (uid "
                f"{os.geteuid()}) or root: it could swap the cache (set MHC_CACHE_DIR to a folder of your own)"
            )  # fmt: skip
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise UnsafeCache(
                folder, f"a folder above the cache is writable by others without the sticky bit (mode {mode:o}): "
                "anyone could swap the cache (chmod o-w or +t it, or set MHC_CACHE_DIR elsewhere)"
            )  # fmt: skip


def _make_private(path: Path) -> None:
    """Create ``path`` (and its missing parents) 0700 whatever the umask; one another process made
    first is left as it is (and checked by the caller)."""
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:  # another rank made it first: checked by the caller
            continue
        os.chmod(folder, 0o700)  # a umask can only take bits away; this one may have taken the owner's


def private_folder(root: Path, *parts: str, create: bool) -> Path:
    """``root/parts...`` after checking the folders above the root (``check_ancestors``), the root
    and every folder below it (``check_owned``); ``create``: missing ones are made private (0700),
    else a missing one raises FileNotFoundError."""
    check_ancestors(root)
    path = root
    for index in range(len(parts) + 1):
        if index:
            path = path / parts[index - 1]
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            if not create:
                raise
            _make_private(path)
            status = os.lstat(path)
        check_owned(path, status, directory=True)
    return path


@contextlib.contextmanager
def open_owned(path: Path) -> Iterator[int]:
    """A descriptor of ``path``, a regular file of this user's that nobody else can write (never
    through a symbolic link). FileNotFoundError where there is none."""
    try:
        descriptor = os.open(path, _READ_FLAGS)
    except OSError as error:
        if error.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise UnsafeCache(path, "it is a symbolic link (not followed)") from None
        raise
    try:
        check_owned(path, os.fstat(descriptor), directory=False)
        yield descriptor
    finally:
        os.close(descriptor)


def read_owned(path: Path) -> bytes:
    """The bytes of ``path`` (``open_owned``)."""
    with open_owned(path) as descriptor, os.fdopen(os.dup(descriptor), "rb") as file:
        return file.read()


def open_checked(path: Path, *, owned: bool) -> int:
    """A descriptor of the regular file ``path`` (the caller closes it). ``owned``: a cache file
    (``open_owned``'s checks, no symbolic link followed); else an installed one, trusted as
    installed (a link there is followed: what is loaded is what its descriptor hashes to)."""
    flags = _READ_FLAGS if owned else os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags)
    except OSError as error:
        if owned and error.errno == errno.ELOOP:
            raise UnsafeCache(path, "it is a symbolic link (not followed)") from None
        raise
    try:
        status = os.fstat(descriptor)
        if owned:
            check_owned(path, status, directory=False)
        elif not stat.S_ISREG(status.st_mode):
            raise UnsafeCache(path, "it is not a regular file")
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def digest_of(descriptor: int) -> tuple[int, str]:
    """Size and sha256 of the open file ``descriptor``, read from its start."""
    digest = hashlib.sha256()
    size = 0
    offset = 0
    while chunk := os.pread(descriptor, 1 << 20, offset):
        digest.update(chunk)
        size += len(chunk)
        offset += len(chunk)
    return size, digest.hexdigest()


def file_digest(path: Path) -> tuple[int, str]:
    """Size and sha256 of ``path`` (followed: a file this process just wrote or an installed one)."""
    with open(path, "rb") as file:
        return digest_of(file.fileno())


def digest_problem(found: tuple[int, str], size: int, sha256: str) -> str | None:
    """Why a file of ``found`` (size, sha256) is not the one recorded as ``size`` and ``sha256``."""
    if found[0] != size:
        return f"it has {found[0]} bytes, {size} were written (truncated or replaced)"
    if found[1] != sha256:
        return "its sha256 differs from the one recorded when it was written"
    return None


def clear_way(path: Path) -> None:
    """Move aside a folder (planted, or left by an older tool) at ``path``, where a file is about to
    be renamed into place: no rename could ever replace it. One warning names both paths."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(status.st_mode):
        return  # a file or a link is replaced by the rename itself
    aside = path.with_name(f".{path.name}.moved-aside-{os.getpid()}-{time.time_ns()}")
    os.rename(path, aside)
    LOG.warning("moved aside the folder %s (a file belongs there) to %s", path, aside)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary name in the same folder (0600, created
    exclusively: never through a link planted there), renamed into place: a reader sees all or nothing."""
    clear_way(path)
    descriptor, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(partial, path)  # replaces a link at ``path`` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


#: Seconds a process waits for another's lock on a cache entry before it builds for itself.
LOCK_TIMEOUT_ENV = "MHC_CACHE_LOCK_TIMEOUT_S"
#: Three times the slowest compile measured under a lock (the finalize publish at top_k = 64 on a
#: loaded host, about a minute); a legitimately slow holder costs a waiter a compile of its own.
DEFAULT_LOCK_TIMEOUT_S = 180.0
#: A wait this long (or half the bound, if less) is worth one warning naming the holder.
_LOCK_NOTICE_S = 30.0


class LockTimeout(UnsafeCache):
    """Another process held a cache entry's lock for longer than the bound."""


def lock_timeout_s() -> float:
    """``MHC_CACHE_LOCK_TIMEOUT_S``, else ``DEFAULT_LOCK_TIMEOUT_S``; anything but a positive finite
    number of seconds raises ValueError naming the variable."""
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{LOCK_TIMEOUT_ENV}: expected a positive, finite number of seconds, got {raw!r}")
    return value


def _holder(descriptor: int) -> str:
    """Who holds the lock, as its holder recorded it (``pid N on host H``), or ``unknown``."""
    recorded = os.pread(descriptor, 256, 0).decode(errors="replace").split()
    if len(recorded) == 2 and recorded[0].isdigit():
        return f"pid {recorded[0]} on host {recorded[1]}"
    return "a process that recorded no pid"


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock (``flock``; the file is created 0600 and kept: removing it would let two
    processes lock two different files). The lock goes with the process, however it ends. The
    holder records its pid and host in it; a waiter says once, after a while, whom it waits for,
    and raises ``LockTimeout`` after ``lock_timeout_s()`` (a stopped holder, a hung compiler)."""
    bound = lock_timeout_s()
    clear_way(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeCache(path, "it is a symbolic link (not followed)") from None
        raise
    try:
        check_owned(path, os.fstat(descriptor), directory=False)
        _acquire(path, descriptor, bound)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _acquire(path: Path, descriptor: int, bound: float) -> None:
    """``flock`` ``descriptor``, polling (a blocking ``flock`` cannot be bounded or report whom it waits for)."""
    start = time.monotonic()
    notice = min(_LOCK_NOTICE_S, bound / 2)
    noticed = False
    pause = 0.001
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= bound:
            raise LockTimeout(
                path, f"{_holder(descriptor)} held it for more than {bound:g} s ({LOCK_TIMEOUT_ENV} sets the "
                "bound): building in this process, without persisting"
            )  # fmt: skip
        if waited >= notice and not noticed:
            noticed = True
            LOG.warning(
                "waiting for the lock %s, held by %s; giving up after %g s (%s)",
                path, _holder(descriptor), bound, LOCK_TIMEOUT_ENV,
            )  # fmt: skip
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


# ------------------------------------------------------------------ scratch folders
@functools.cache
def _process_tag() -> str:
    """What tells this host and pid namespace from another sharing the cache (a shared file system,
    containers): a pid is only this process's, alive or dead, where the tag matches."""
    parts = [socket.gethostname()]
    for source in ("/proc/self/ns/pid", "/proc/sys/kernel/random/boot_id"):
        with contextlib.suppress(OSError):
            parts.append(os.readlink(source) if source.startswith("/proc/self") else Path(source).read_text())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def _dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale_scratch(folder: Path, prefix: str) -> None:
    """Remove the scratch folders (``<prefix><pid>-<tag>-...``) that dead processes of this host
    left in ``folder`` (a SIGKILL mid-write), and any of an older mhc-core's (no pid in the name)
    older than an hour."""
    tag = _process_tag()
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
                continue
            name = entry.name[len(prefix) :]
            pid, made_by = [*name.split("-"), ""][:2]
            if pid.isdigit() and made_by == tag:
                stale = _dead(int(pid))
            elif "-" not in name:  # an older mhc-core's: no pid to ask
                try:
                    stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > 3600
                except OSError:
                    continue
            else:
                continue  # another host's, or another pid namespace's: its pid means nothing here
            if stale:
                shutil.rmtree(entry.path, ignore_errors=True)


@contextlib.contextmanager
def scratch(folder: Path, prefix: str) -> Iterator[Path]:
    """A private temporary folder in ``folder`` named after this process (``<prefix><pid>-<tag>-``),
    removed afterwards; those of dead processes are removed first (``remove_stale_scratch``)."""
    remove_stale_scratch(folder, prefix)
    with tempfile.TemporaryDirectory(prefix=f"{prefix}{os.getpid()}-{_process_tag()}-", dir=folder) as made:
        yield Path(made)
