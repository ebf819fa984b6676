"""Lock files kvobs can trust: where they live, what they are called, and how they are opened.

A cache lock is only as safe as its file. In a world-writable directory such as ``/dev/shm`` another user
can plant a file (or a symlink, or a hard link) at a predictable lock path before kvobs starts; if kvobs
accepted it, that user could hold the lock and make every transfer time out. So by default lock files live
in a private per-user directory (mode 0700, owner checked), and every file kvobs opens is checked on the
open descriptor itself (``O_NOFOLLOW``, then ``fstat``), leaving no window between check and use.

Two kinds of file are opened here:

- kvobs's own lock files: a regular file owned by this user, mode exactly 0600, one link;
- an adopted file that another program created and locks (FastDeploy's ``fcntl.flock`` file in
  ``/dev/shm``), which kvobs must share to exclude that program: still a regular file owned by this user
  and never a symlink, but its mode, link count and directory are that program's business.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from collections.abc import Callable

from kvobs.errors import InvalidLockName, UnsafeLockFile
from kvobs.semconv import ENV_LOCK_DIR

__all__ = [
    "PROC_FD",
    "InvalidLockName",
    "UnsafeLockFile",
    "base_directory",
    "lock_directory",
    "lock_path",
    "open_lock_file",
    "private_directory",
    "reopen",
]

_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_MODE = 0o600
_DIRECTORY_MODE = 0o700
PROC_FD = "/proc/self/fd"  # where the kernel re-opens an open file by its descriptor


def base_directory() -> str:
    """``KVOBS_LOCK_DIR``, else ``/dev/shm`` (memory-backed, shared by the host's processes), else tmp."""
    configured = os.environ.get(ENV_LOCK_DIR)
    if configured:
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def private_directory(base: str | None = None) -> str:
    """This user's lock directory under `base` (default `base_directory()`), created mode 0700 if missing.

    Refused unless `base` is safe (see `_check_base`) and the directory is a real directory (not a symlink)
    owned by this user that nobody else can enter: another user who creates it first gets a clear error
    here, never a lock.
    """
    origin = f" (set by {ENV_LOCK_DIR})" if base is None and os.environ.get(ENV_LOCK_DIR) else ""
    base = base_directory() if base is None else base
    name = f"kvobs-{os.geteuid()}"
    path = os.path.join(base, name)
    base_fd = _open_base(base, origin)
    try:
        _check_base(base_fd, base, origin)
        try:
            os.mkdir(name, _DIRECTORY_MODE, dir_fd=base_fd)
            created = True
        except FileExistsError:
            created = False
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)
        except OSError as exc:
            _refuse_unsafe_entry(path, exc, "lock directory path", "directory", os.path.isdir)
            raise
    finally:
        os.close(base_fd)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise UnsafeLockFile(path, f"the directory is owned by uid {info.st_uid}, not by uid {os.geteuid()}")
        if created:
            os.fchmod(fd, _DIRECTORY_MODE)  # exactly 0700, whatever the umask
        elif stat.S_IMODE(info.st_mode) & 0o077:
            raise UnsafeLockFile(
                path, f"the directory has mode {stat.S_IMODE(info.st_mode):04o}; others must have no access (0700)"
            )
    finally:
        os.close(fd)
    return path


def lock_directory(directory: str | os.PathLike[str] | None = None) -> str:
    """The directory lock files go in: `directory` as given (checked like a base directory), else this
    user's `private_directory()`."""
    if directory is None:
        return private_directory()
    given = os.fspath(directory)
    fd = _open_base(given, "")
    try:
        _check_base(fd, given, "")
    finally:
        os.close(fd)
    return given


def _open_base(base: str, origin: str) -> int:
    """The directory the lock directory (or the lock files) go in, opened so that what is checked is what
    is used; `origin` says where its name came from, for the errors."""
    try:
        return os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(
            errno.ENOENT,
            f"the cache lock directory does not exist{origin} (point {ENV_LOCK_DIR}, or the lock's "
            "directory=, at an existing directory)",
            base,
        ) from None
    except NotADirectoryError:
        raise UnsafeLockFile(base, f"it is not a directory{origin}") from None


def _check_base(fd: int, base: str, origin: str) -> None:
    """Refuse a directory in which another user could rename or replace what kvobs keeps there.

    Whoever may rename entries of the directory can move this user's lock directory (or a lock file) away;
    the next worker then creates a fresh one and two workers hold "the same" lock on different files. The
    owner can always rename entries, and so can anyone with write access unless the sticky bit is set (as
    on ``/tmp`` and ``/dev/shm``), which limits renames to the entry's owner.
    """
    info = os.fstat(fd)
    if info.st_uid not in (0, os.geteuid()):
        raise UnsafeLockFile(
            base, f"the directory is owned by uid {info.st_uid}{origin}, who could rename this user's locks away; "
            "use a directory owned by root or by this user"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise UnsafeLockFile(
            base, f"the directory is writable by others (mode {mode:04o}) without the sticky bit{origin}: any "
            "of them could rename this user's locks away, and two workers would hold the same lock on "
            "different files; set the sticky bit (chmod +t) or use a directory only this user can write"
        )


def lock_path(name: str, directory: str, suffix: str = ".lock") -> str:
    """``<directory>/kvobs-<name><suffix>``, after checking that `name` makes a valid file name there."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidLockName(name, "use a non-empty name of letters, digits, '_', '.', '-'")
    filename = f"kvobs-{name}{suffix}"
    limit = _name_max(directory)
    if len(os.fsencode(filename)) > limit:
        raise InvalidLockName(
            name, f"the lock file name {filename!r} is longer than the {limit} bytes the file system allows"
        )
    return os.path.join(directory, filename)


def _name_max(directory: str) -> int:
    """The longest file name `directory`'s file system accepts (255 where it cannot tell)."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def open_lock_file(path: str, *, create: bool, adopt: bool = False) -> int:
    """Open the lock file at `path` read-write, without following a symlink, and check what was opened.

    create: make the file (mode exactly 0600) when it is missing; otherwise a missing file is a
        FileNotFoundError saying its owner must create it first.
    adopt: the file belongs to another program (e.g. FastDeploy's own flock file): only symlinks, files
        that are not regular and files owned by another user are refused. Without `adopt`, the file must
        also have mode 0600 and a single link, as every file kvobs creates has.

    Refusals raise `UnsafeLockFile` naming the path and the reason; other OS errors come out unchanged.
    """
    fd, created = _open(path, create)
    try:
        if created:
            os.fchmod(fd, _FILE_MODE)  # exactly 0600, whatever the umask
        problem = _problem(os.fstat(fd), adopt)
    except BaseException:
        os.close(fd)
        raise
    if problem:
        os.close(fd)
        raise UnsafeLockFile(path, problem)
    return fd


def _open(path: str, create: bool) -> tuple[int, bool]:
    """(fd, whether this call created the file). ``O_EXCL`` first, so only a file we made gets chmod."""
    try:
        if create:
            try:
                return os.open(path, _OPEN_FLAGS | os.O_CREAT | os.O_EXCL, _FILE_MODE), True
            except FileExistsError:
                pass
        return os.open(path, _OPEN_FLAGS), False
    except FileNotFoundError as exc:
        if create:
            raise
        raise FileNotFoundError(
            exc.errno,
            "cache lock file does not exist; its owner must create it first (create=True) before others attach",
            path,
        ) from None
    except OSError as exc:
        _refuse_unsafe_entry(path, exc, "lock path", "regular file", os.path.isfile)
        raise


def _refuse_unsafe_entry(path: str, error: OSError, place: str, kind: str, is_kind: Callable[[str], bool]) -> None:
    """After opening `path` failed with `error` (``O_NOFOLLOW`` refuses a symlink): UnsafeLockFile when a
    symlink, or an entry that is not a `kind`, is what stands there."""
    if os.path.islink(path):
        raise UnsafeLockFile(path, f"a symlink was found at the {place}") from error
    if os.path.lexists(path) and not is_kind(path):
        raise UnsafeLockFile(path, f"it is not a {kind}") from error


def _problem(info: os.stat_result, adopt: bool) -> str:
    """Why the opened file must not be used as a lock, or "" when it may."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"the file is owned by uid {info.st_uid}, not by uid {os.geteuid()}"
    if adopt:
        return ""
    mode = stat.S_IMODE(info.st_mode)
    if mode != _FILE_MODE:
        return f"the file has mode {mode:04o}, not 0600"
    if info.st_nlink != 1:
        return f"the file has {info.st_nlink} links; a lock file kvobs made has exactly one"
    return ""


def reopen(fd: int, path: str) -> int:
    """A new open file description of the file open at `fd` (the same inode, even if `path` was unlinked
    or replaced since).

    Locks that belong to an open file description (``flock``, OFD byte-range locks) are shared by every
    descriptor dup'ed or inherited from it; a forked child or a second holder needs a description of its
    own. Through ``/proc/self/fd`` the kernel hands back exactly the file we checked when we opened it;
    without ``/proc``, `path` is re-opened and must still be that file.
    """
    if os.path.isdir(PROC_FD):
        return os.open(f"{PROC_FD}/{fd}", os.O_RDWR | os.O_CLOEXEC)
    return _reopen_by_path(fd, path)


def _reopen_by_path(fd: int, path: str) -> int:
    new_fd = os.open(path, _OPEN_FLAGS)
    old = os.fstat(fd)
    new = os.fstat(new_fd)
    if (old.st_dev, old.st_ino) != (new.st_dev, new.st_ino):
        os.close(new_fd)
        raise UnsafeLockFile(path, "the lock file was replaced by another file while it was in use")
    return new_fd
