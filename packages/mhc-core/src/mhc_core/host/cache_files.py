"""Files in the on-disk cache that eight ranks and a shared machine can trust.

The cache (``MHC_CACHE_DIR``, else the user's cache folder) holds libraries this process will
``dlopen``: whoever can write a file there runs code as the user. So every folder from the cache
root down is created private (0700) and, before it is used, must be a real directory (not a
symbolic link) owned by this user and writable by nobody else; every file read from it likewise,
opened without following a symbolic link. A library's size and sha256 are recorded beside it when
it is written and compared before it is loaded (a truncated library mapped by ``dlopen`` is a
SIGBUS, not an exception). Files are written under a unique temporary name and renamed into place,
so a reader sees a whole file or none, and a lock file per entry (``flock``) lets concurrent
processes build it once: the others wait, then load it.

``UnsafeCache`` carries the path and the reason; the callers warn once per file and process
(``warn_once``) and then do without the cache: compile, build or (where nothing can) raise.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import stat
import tempfile
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


def private_folder(root: Path, *parts: str, create: bool) -> Path:
    """``root/parts...`` after checking the root and every folder below it (``check_owned``);
    ``create``: missing ones are made private (0700), else a missing one raises FileNotFoundError."""
    path = root
    for index in range(len(parts) + 1):
        if index:
            path = path / parts[index - 1]
        try:
            status = os.lstat(path)
        except FileNotFoundError:
            if not create:
                raise
            if index == 0:
                path.parent.mkdir(parents=True, exist_ok=True)  # above the cache: not ours to judge
            with contextlib.suppress(FileExistsError):  # another rank made it first: checked below
                os.mkdir(path, 0o700)
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


def library_problem(path: Path, size: int, sha256: str, *, owned: bool = True) -> str | None:
    """Why ``path`` is not the library recorded as ``size`` bytes with ``sha256`` (None: it is).
    ``owned``: a cache file (``open_owned``'s checks); else an installed one, trusted as installed."""
    try:
        if owned:
            with open_owned(path) as descriptor:
                found_size, found_sha256 = digest_of(descriptor)
        else:
            found_size, found_sha256 = file_digest(path)
    except UnsafeCache as error:
        return error.reason
    except OSError as error:
        return f"it cannot be read ({error.strerror or error})"
    if found_size != size:
        return f"it has {found_size} bytes, {size} were written (truncated or replaced)"
    if found_sha256 != sha256:
        return "its sha256 differs from the one recorded when it was written"
    return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a unique temporary name in the same folder (0600, created
    exclusively: never through a link planted there), renamed into place: a reader sees all or nothing."""
    descriptor, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(partial, path)  # replaces a link at ``path`` itself, never its target
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock (``flock``; the file is created 0600 and kept: removing it would let two
    processes lock two different files). The lock goes with the process, however it ends."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeCache(path, "it is a symbolic link (not followed)") from None
        raise
    try:
        check_owned(path, os.fstat(descriptor), directory=False)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock
