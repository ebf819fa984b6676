"""Linux open-file-description (OFD) byte-range locks, as `fcntl.fcntl` takes them.

OFD locks (Linux >= 3.15) belong to an open file description, not to a process: two descriptions of one
file exclude each other even inside one process, any thread may release them, and the kernel drops them
when the last descriptor of the description closes, so a holder killed by SIGKILL leaves nothing behind.
Unlike ``flock`` they lock byte ranges, shared (``F_RDLCK``) or exclusive (``F_WRLCK``).

Python passes the ``struct flock`` argument as raw bytes, so its layout is spelled out here and checked by
the tests against the kernel (a classic ``fcntl.lockf`` lock read back through ``F_OFD_GETLK``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
from collections.abc import Callable
from typing import NamedTuple

from kvobs.errors import OFDUnsupported

__all__ = [
    "FLOCK",
    "F_OFD_GETLK",
    "F_OFD_SETLK",
    "UNLOCK_ALL",
    "Conflict",
    "OFDUnsupported",
    "check_supported",
    "conflict",
    "granted",
    "is_contention",
    "pack",
]

# Python >= 3.9 exports them on Linux; the values are the kernel's (include/uapi/asm-generic/fcntl.h).
F_OFD_GETLK: int = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK: int = getattr(fcntl, "F_OFD_SETLK", 37)

# struct flock on 64-bit Linux (x86_64, aarch64): short l_type; short l_whence; (4 bytes padding)
# off_t l_start; off_t l_len; pid_t l_pid; (4 bytes padding to the struct's 8-byte alignment).
FLOCK = struct.Struct("=hh4xqqi4x")

# l_len 0 means "to the end of the file, however far it grows": every lock this description holds.
UNLOCK_ALL: bytes = FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)

_CONTENTION = (errno.EAGAIN, errno.EACCES)  # POSIX allows either for "held by someone else"


class Conflict(NamedTuple):
    """The first lock that blocks a request, as ``F_OFD_GETLK`` reports it (its holder's pid is not
    reported for OFD locks: -1)."""

    exclusive: bool
    start: int
    length: int


def pack(kind: int, start: int, length: int) -> bytes:
    """The ``struct flock`` for `kind` (F_RDLCK, F_WRLCK, F_UNLCK) over bytes [start, start + length).

    l_pid must be 0 for OFD requests (the kernel refuses anything else with EINVAL).
    """
    return FLOCK.pack(kind, os.SEEK_SET, start, length, 0)


def conflict(fd: int, kind: int, start: int, length: int) -> Conflict | None:
    """The lock of another description that a `kind` request on [start, start + length) would wait for,
    or None when it would be granted now."""
    l_type, _, l_start, l_len, _ = FLOCK.unpack(fcntl.fcntl(fd, F_OFD_GETLK, pack(kind, start, length)))
    if l_type == fcntl.F_UNLCK:
        return None
    return Conflict(l_type == fcntl.F_WRLCK, l_start, l_len)


def is_contention(exc: OSError) -> bool:
    """Whether a failed ``F_OFD_SETLK`` means "held by someone else" (as opposed to a real error)."""
    return exc.errno in _CONTENTION


def granted(setlk: Callable[[bytes], object], request: bytes) -> bool:
    """One non-blocking request through `setlk` (``F_OFD_SETLK`` on a description): True when granted,
    False when someone else holds the range; any other error is raised."""
    try:
        setlk(request)
        return True
    except OSError as exc:
        if is_contention(exc):
            return False
        raise


def check_supported(fd: int) -> None:
    """Raise OFDUnsupported unless OFD locks work on `fd` with the layout above."""
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        raise OFDUnsupported(
            errno.ENOTSUP, f"OFD byte-range locks need 64-bit Linux; this is {sys.platform}, "
            f"{8 * struct.calcsize('P')}-bit"
        )
    try:
        conflict(fd, fcntl.F_WRLCK, 0, 1)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS):
            raise OFDUnsupported(exc.errno, "this kernel has no OFD byte-range locks (Linux >= 3.15 needed)") from exc
        raise
