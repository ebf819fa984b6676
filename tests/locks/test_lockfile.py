"""Lock files and their directory, attacked the way another local user could: real files, links, owners."""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import resource
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvobs.errors import KVObsError
from kvobs.locks._lockfile import (
    InvalidLockName,
    UnsafeLockFile,
    _reopen_by_path,
    base_directory,
    lock_directory,
    lock_path,
    open_lock_file,
    private_directory,
    reopen,
)

OTHER_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting a file owned by another user needs root")


@pytest.fixture
def umask_zero() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _close(fd: int) -> None:
    os.close(fd)


# --- the private per-user directory ---------------------------------------------------------------------


def test_private_directory_is_created_0700_whatever_the_umask(tmp_path: Path, umask_zero: None) -> None:
    path = private_directory(str(tmp_path))
    assert path == str(tmp_path / f"kvobs-{os.geteuid()}")
    info = os.lstat(path)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.geteuid()
    assert private_directory(str(tmp_path)) == path  # the second caller finds and accepts it


def test_private_directory_honours_a_tight_umask(tmp_path: Path) -> None:
    old = os.umask(0o777)
    try:
        path = private_directory(str(tmp_path))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700  # usable by its owner, still private


@needs_root
def test_private_directory_planted_by_another_user_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / f"kvobs-{os.geteuid()}"
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeLockFile, match=f"owned by uid {OTHER_UID}") as caught:
        private_directory(str(tmp_path))
    assert caught.value.path == str(planted)


def test_private_directory_others_can_enter_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / f"kvobs-{os.geteuid()}"
    planted.mkdir()
    planted.chmod(0o755)
    with pytest.raises(UnsafeLockFile, match="mode 0755"):
        private_directory(str(tmp_path))


def test_symlink_at_private_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / f"kvobs-{os.geteuid()}").symlink_to(elsewhere)
    with pytest.raises(UnsafeLockFile, match="symlink"):
        private_directory(str(tmp_path))


def test_file_at_private_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / f"kvobs-{os.geteuid()}").write_text("")
    with pytest.raises(UnsafeLockFile, match="not a directory"):
        private_directory(str(tmp_path))


def test_missing_base_directory_names_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOBS_LOCK_DIR", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="KVOBS_LOCK_DIR") as caught:
        lock_directory()
    assert caught.value.filename == str(tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


def test_lock_dir_variable_naming_a_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a_file = tmp_path / "not-a-directory"
    a_file.write_text("")
    monkeypatch.setenv("KVOBS_LOCK_DIR", str(a_file))
    with pytest.raises(UnsafeLockFile, match="not a directory.*KVOBS_LOCK_DIR") as caught:
        lock_directory()
    assert caught.value.path == str(a_file)
    assert a_file.read_text() == ""


def _as_other_user(action: Callable[[], None]) -> int:
    """Run `action` in a forked child that has become another, unprivileged user (a real one: the kernel
    checks its permissions); the child's exit status: 0 when `action` returned, the errno it failed with."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            action()
        except OSError as exc:
            code = exc.errno or 100
        except BaseException:
            code = 101
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path sits in root's private 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="kvobs-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@needs_root
def test_base_directory_without_the_sticky_bit_is_refused(reachable: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """World-writable without the sticky bit, anyone may rename this user's lock directory away: the next
    worker would create a fresh one and lock other files than the workers already running (split brain)."""
    base = reachable / "shared"
    base.mkdir()
    base.chmod(0o777)
    planted = base / f"kvobs-{os.geteuid()}"
    planted.mkdir(mode=0o700)
    # The attack is real: another user can move this user's directory away from such a base.
    assert _as_other_user(lambda: os.rename(planted, base / "moved")) == 0
    monkeypatch.setenv("KVOBS_LOCK_DIR", str(base))
    with pytest.raises(UnsafeLockFile, match="writable by others .*without the sticky bit.*KVOBS_LOCK_DIR") as caught:
        lock_directory()
    assert caught.value.path == str(base)
    assert sorted(p.name for p in base.iterdir()) == ["moved"]  # nothing created there
    with pytest.raises(UnsafeLockFile, match="without the sticky bit"):
        lock_directory(base)  # the same for a directory given explicitly


@needs_root
def test_sticky_base_directory_is_accepted_and_keeps_the_lock_directory(
    reachable: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = reachable / "shared"
    base.mkdir()
    base.chmod(0o1777)  # like /tmp and /dev/shm
    monkeypatch.setenv("KVOBS_LOCK_DIR", str(base))
    path = lock_directory()
    assert path == str(base / f"kvobs-{os.geteuid()}")
    assert _as_other_user(lambda: os.rename(path, base / "moved")) == errno.EPERM
    assert os.path.isdir(path)


@needs_root
def test_base_directory_owned_by_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its owner may rename anything in it, sticky bit or not."""
    base = tmp_path / "theirs"
    base.mkdir()
    base.chmod(0o1777)
    os.chown(base, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("KVOBS_LOCK_DIR", str(base))
    with pytest.raises(UnsafeLockFile, match=f"owned by uid {OTHER_UID}") as caught:
        lock_directory()
    assert caught.value.path == str(base)
    assert list(base.iterdir()) == []


def test_explicit_directory_is_used_as_given(tmp_path: Path) -> None:
    assert lock_directory(tmp_path) == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_default_base_without_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVOBS_LOCK_DIR", raising=False)
    usable_shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK)
    assert base_directory() == ("/dev/shm" if usable_shm else tempfile.gettempdir())
    path = lock_directory()
    assert path == os.path.join(base_directory(), f"kvobs-{os.geteuid()}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


# --- names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "a/b", "../kv", "a b", "kv\n", "é", "kv:1", None, 3])
def test_invalid_names(tmp_path: Path, name: object) -> None:
    with pytest.raises(InvalidLockName, match="invalid cache lock name"):
        lock_path(name, str(tmp_path))  # type: ignore[arg-type]


def test_name_too_long_for_the_file_system_is_a_clear_value_error(tmp_path: Path) -> None:
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = "k" * (limit - len("kvobs-.lock"))
    path = lock_path(longest, str(tmp_path))
    os.close(open_lock_file(path, create=True))  # the longest name that fits really works
    with pytest.raises(ValueError, match=f"longer than the {limit} bytes") as caught:
        lock_path(longest + "k", str(tmp_path))
    assert isinstance(caught.value, KVObsError)


def test_errors_pickle() -> None:
    unsafe = pickle.loads(pickle.dumps(UnsafeLockFile("/x/kvobs-kv.lock", "it is not a regular file")))
    assert isinstance(unsafe, PermissionError) and isinstance(unsafe, KVObsError)
    assert (unsafe.path, unsafe.reason) == ("/x/kvobs-kv.lock", "it is not a regular file")
    assert str(unsafe) == "refusing cache lock path /x/kvobs-kv.lock: it is not a regular file"
    invalid = pickle.loads(pickle.dumps(InvalidLockName("a/b", "bad")))
    assert isinstance(invalid, ValueError) and (invalid.name, invalid.reason) == ("a/b", "bad")
    assert str(invalid) == "invalid cache lock name 'a/b': bad"


# --- opening kvobs's own lock files -----------------------------------------------------------------------


def test_created_file_is_0600_whatever_the_umask(tmp_path: Path, umask_zero: None) -> None:
    path = tmp_path / "kvobs-kv.lock"
    fd = open_lock_file(str(path), create=True)
    _close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    _close(open_lock_file(str(path), create=False))  # and it passes its own checks when re-opened


@needs_root
@pytest.mark.parametrize("adopt", [False, True])
def test_file_owned_by_another_user_is_refused(tmp_path: Path, adopt: bool) -> None:
    path = tmp_path / "kvobs-kv.lock"
    path.touch(mode=0o600)
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeLockFile, match=f"owned by uid {OTHER_UID}, not by uid {os.geteuid()}") as caught:
        open_lock_file(str(path), create=True, adopt=adopt)
    assert caught.value.path == str(path)


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o700, 0o4600])
def test_file_with_another_mode_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "kvobs-kv.lock"
    path.touch()
    path.chmod(mode)
    with pytest.raises(UnsafeLockFile, match=f"mode {mode:04o}, not 0600"):
        open_lock_file(str(path), create=True)
    assert stat.S_IMODE(path.stat().st_mode) == mode  # refused, not "repaired"


def test_hard_link_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.touch(mode=0o600)
    path = tmp_path / "kvobs-kv.lock"
    os.link(target, path)
    with pytest.raises(UnsafeLockFile, match="2 links"):
        open_lock_file(str(path), create=False)


@pytest.mark.parametrize("adopt", [False, True])
def test_symlink_is_refused_and_its_target_untouched(tmp_path: Path, adopt: bool) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("precious")
    target.chmod(0o600)
    path = tmp_path / "kvobs-kv.lock"
    path.symlink_to(target)
    with pytest.raises(UnsafeLockFile, match="symlink"):
        open_lock_file(str(path), create=True, adopt=adopt)
    assert target.read_text() == "precious"


def test_dangling_symlink_creates_nothing(tmp_path: Path) -> None:
    absent = tmp_path / "absent"
    (tmp_path / "kvobs-kv.lock").symlink_to(absent)
    with pytest.raises(UnsafeLockFile, match="symlink"):
        open_lock_file(str(tmp_path / "kvobs-kv.lock"), create=True)
    assert not absent.exists()


@pytest.mark.parametrize("make", [os.mkdir, os.mkfifo], ids=["directory", "fifo"])
@pytest.mark.parametrize("adopt", [False, True])
def test_non_regular_file_is_refused(tmp_path: Path, make: Callable[[Path], None], adopt: bool) -> None:
    make(tmp_path / "kvobs-kv.lock")
    with pytest.raises(UnsafeLockFile, match="not a regular file"):
        open_lock_file(str(tmp_path / "kvobs-kv.lock"), create=True, adopt=adopt)


def test_attach_to_missing_file_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "kvobs-kv.lock"
    with pytest.raises(FileNotFoundError, match="create it first") as caught:
        open_lock_file(str(path), create=False)
    assert caught.value.filename == str(path)
    assert not path.exists()


def test_unexpected_os_error_comes_out_unchanged(tmp_path: Path) -> None:
    """Out of descriptors: EMFILE must reach the caller as itself, not as a refusal or a missing file."""
    path = tmp_path / "kvobs-kv.lock"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe, hard))  # the next open() has no number left
    try:
        with pytest.raises(OSError) as caught:
            open_lock_file(str(path), create=True)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert type(caught.value) is OSError and caught.value.errno == errno.EMFILE
    assert not path.exists()


# --- adopting another program's lock file ---------------------------------------------------------------


def test_adopt_accepts_a_file_another_program_created(tmp_path: Path) -> None:
    """FastDeploy-style: its own /dev/shm flock file, mode 0644 from its umask; kvobs must share it."""
    path = tmp_path / "fd_lock_kvcache.8000"
    path.touch(mode=0o644)
    path.chmod(0o644)
    os.link(path, tmp_path / "second-name")
    fd = open_lock_file(str(path), create=False, adopt=True)
    theirs = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(theirs, fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):  # one file, one lock: kvobs and the program exclude each other
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(theirs)
        os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # adopted, never changed


def test_adopt_creates_a_missing_file_private(tmp_path: Path, umask_zero: None) -> None:
    path = tmp_path / "fd_lock_kvcache.8000"
    _close(open_lock_file(str(path), create=True, adopt=True))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# --- re-opening -----------------------------------------------------------------------------------------


def test_reopen_gives_a_new_description_of_the_same_file_even_unlinked(tmp_path: Path) -> None:
    path = tmp_path / f"kvobs-{uuid.uuid4().hex}.lock"
    fd = open_lock_file(str(path), create=True)
    os.unlink(path)
    again = reopen(fd, str(path))
    try:
        assert os.fstat(again).st_ino == os.fstat(fd).st_ino
        assert not path.exists()  # never re-created
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):  # a description of its own: the flocks exclude each other
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(again)
        os.close(fd)


def test_reopen_by_path_refuses_a_replaced_file(tmp_path: Path) -> None:
    """Where /proc is missing the path is re-opened: it must still lead to the file we checked."""
    path = tmp_path / "kvobs-kv.lock"
    fd = open_lock_file(str(path), create=True)
    try:
        same = _reopen_by_path(fd, str(path))
        assert os.fstat(same).st_ino == os.fstat(fd).st_ino
        os.close(same)
        os.unlink(path)
        _close(open_lock_file(str(path), create=True))  # a different file under the same name
        with pytest.raises(UnsafeLockFile, match="replaced"):
            _reopen_by_path(fd, str(path))
    finally:
        os.close(fd)
