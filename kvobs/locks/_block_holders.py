"""The shared record beside a BlockLock's byte-range locks: which path claimed each block last.

The kernel says that a range is locked, never by whom (``F_OFD_GETLK`` reports pid -1 for OFD locks). So
every claim stamps a one-byte holder code at the first byte of each range it locks (a run of blocks, or a
writer's turnstile), in a memory map of the lock file that all processes share, laid out like the lock
bytes themselves; a waiter reads the code where the kernel says its conflict starts. The stamps are
telemetry: written after the lock is granted and read without any lock, so a waiter racing a new holder may
name the previous one. The map also holds a header (magic, number of blocks) that every process checks.

Codes: the well-known holders (the transfer paths and the forward pass) have fixed codes; any other name is
written once into a shared name table (slot chosen by a hash of the name, linear probing). Two processes
registering two different new names into the same free slot at the same instant could mislabel one of them;
holder names are a small fixed set, so that race needs two brand-new names and an exact tie.
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
import struct
import time
import zlib
from collections import deque
from itertools import repeat
from operator import add

from kvobs.errors import LockInitTimeout
from kvobs.locks import _ofd as ofd
from kvobs.locks._cache_lock import UNKNOWN_HOLDER
from kvobs.locks._polling import poll
from kvobs.semconv import HOLDER_FORWARD, PATH_PREFETCH, PATH_SEND, PATH_WRITE_BACK

__all__ = ["INIT_LOCK_BYTE", "HolderTable"]

_MAGIC = b"KVOBSBL1"
_HEADER = struct.Struct("=8sQ")  # magic, number of blocks
_NAMES_AT = 64
_NAME_SLOT = 32  # one length byte, then up to 31 bytes of UTF-8
_NAME_SLOTS = 256
_CODES_AT = _NAMES_AT + _NAME_SLOT * _NAME_SLOTS
_BUILTIN = (UNKNOWN_HOLDER, PATH_PREFETCH, PATH_WRITE_BACK, PATH_SEND, HOLDER_FORWARD, "direct")
_FIRST_CUSTOM = 16
_INIT_WAIT_S = 10.0
_INIT_PAUSE_S = 1e-3
_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible sleep", "Z": "a zombie",
           "R": "running", "S": "sleeping"}

# A byte no claim ever covers (claims lock bytes below 2 * num_blocks): whoever holds it initialises or
# checks the header, so a second opener never reads a half-written one.
INIT_LOCK_BYTE = 1 << 62


class HolderTable:
    """The mapped record of one lock file: header, name table, one holder code per lock byte (each block's
    data byte, then each block's turnstile byte)."""

    def __init__(self, fd: int, num_blocks: int, path: str) -> None:
        self.num_blocks = num_blocks
        self._codes: dict[str, int] = {name: code for code, name in enumerate(_BUILTIN)}
        _take_init_byte(fd, path)
        try:
            self._map = _map_checked(fd, num_blocks, path)
        finally:
            fcntl.fcntl(fd, ofd.F_OFD_SETLK, ofd.pack(fcntl.F_UNLCK, INIT_LOCK_BYTE, 1))
        self._set = self._map.__setitem__

    def code(self, holder: str) -> int:
        """The one-byte code of `holder`, registering the name in the shared table the first time."""
        code = self._codes.get(holder)
        if code is None:
            code = self._codes[holder] = self._register(holder)
        return code

    def stamp(self, starts: list[int], code: int) -> None:
        """Record `code` as the holder of the ranges beginning at lock bytes `starts` (one C-level pass)."""
        if len(starts) == 1:
            self._set(_CODES_AT + starts[0], code)
        else:
            deque(map(self._set, map(add, starts, repeat(_CODES_AT)), repeat(code)), 0)

    def holder_at(self, byte: int) -> str:
        """The holder last stamped at lock byte `byte` ("unknown" if none, or outside the lock bytes)."""
        if not 0 <= byte < 2 * self.num_blocks:
            return UNKNOWN_HOLDER
        code = self._map[_CODES_AT + byte]
        if code < _FIRST_CUSTOM:
            return _BUILTIN[code] if code < len(_BUILTIN) else UNKNOWN_HOLDER
        at = _NAMES_AT + code * _NAME_SLOT
        length = self._map[at]
        return self._map[at + 1 : at + 1 + length].decode("utf-8", "replace") or UNKNOWN_HOLDER

    def _register(self, holder: str) -> int:
        encoded = holder.encode("utf-8")[: _NAME_SLOT - 1]
        custom = _NAME_SLOTS - _FIRST_CUSTOM
        first = zlib.crc32(encoded) % custom
        for probe in range(custom):
            code = _FIRST_CUSTOM + (first + probe) % custom
            at = _NAMES_AT + code * _NAME_SLOT
            length = self._map[at]
            if length == 0:
                self._map[at + 1 : at + 1 + len(encoded)] = encoded
                self._map[at] = len(encoded)  # the length last: a reader sees an empty or a whole name
                return code
            if self._map[at + 1 : at + 1 + length] == encoded:
                return code
        return 0  # the table is full: the holder shows as "unknown"

    def close(self) -> None:
        self._map.close()


def _take_init_byte(fd: int, path: str) -> None:
    """Poll for the init byte: held only while an opener writes or reads the header, but never wait forever
    on a process stopped in the middle of it, and then say which one it is."""
    setlk = functools.partial(fcntl.fcntl, fd, ofd.F_OFD_SETLK)
    attempt = functools.partial(ofd.granted, setlk, ofd.pack(fcntl.F_WRLCK, INIT_LOCK_BYTE, 1))
    if not poll(attempt, time.monotonic() + _INIT_WAIT_S, _INIT_PAUSE_S, _INIT_PAUSE_S):
        holders = ", ".join(f"pid {pid} ({_process_state(pid)})" for pid in _init_byte_holders(os.fstat(fd)))
        raise LockInitTimeout(path, _INIT_WAIT_S, holder=holders or "holder not found in /proc")


def _init_byte_holders(file: os.stat_result) -> list[int]:
    """The processes with a description of `file` that locks the init byte. The kernel reports no pid for OFD
    locks (``F_OFD_GETLK`` and /proc/locks give -1), but each descriptor's /proc/<pid>/fdinfo lists the locks
    of its own description; readable for this user's processes (all of them as root). Runs once, after the
    wait timed out, so scanning every process costs nothing that matters."""
    device = f"{os.major(file.st_dev):02x}:{os.minor(file.st_dev):02x}:{file.st_ino} {INIT_LOCK_BYTE} "
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            descriptors = os.listdir(f"/proc/{pid}/fdinfo")
        except OSError:  # gone, or another user's
            continue
        for descriptor in descriptors:
            try:
                with open(f"/proc/{pid}/fdinfo/{descriptor}") as info:
                    found = any(line.startswith("lock:") and device in line for line in info)
            except OSError:
                continue
            if found:
                holders.append(int(pid))
                break
    return holders


def _process_state(pid: int) -> str:
    """What /proc says process `pid` is doing ("stopped" for SIGSTOP), or "state unknown"."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            code = stat.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    return _STATES.get(code, f"state {code}")


def _map_checked(fd: int, num_blocks: int, path: str) -> mmap.mmap:
    """Map the file, writing the header if nobody has (a new file, or an opener that died before the magic),
    else checking it. The magic is written last, so it marks a complete header."""
    size = _CODES_AT + 2 * num_blocks
    current = os.fstat(fd).st_size
    if current >= _HEADER.size:
        magic, recorded = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
        if magic == _MAGIC:
            if recorded != num_blocks:
                raise ValueError(
                    f"block lock file {path} was created for {recorded} blocks, not {num_blocks}: every "
                    "process must open it with the same num_blocks"
                )
            return mmap.mmap(fd, size)
        if magic.strip(b"\0"):
            raise ValueError(f"{path} is not a kvobs block lock file (unknown header {magic!r})")
    os.ftruncate(fd, size)
    table = mmap.mmap(fd, size)
    table[: _HEADER.size] = _HEADER.pack(b"\0" * len(_MAGIC), num_blocks)
    table[: len(_MAGIC)] = _MAGIC
    return table
