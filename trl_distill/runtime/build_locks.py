"""Where torch builds the ops DeepSpeed compiles on first use, and the `lock` a stopped build leaves behind.

torch builds an op (DeepSpeed's `deepspeed_shm_comm`, the first time a process group starts on CPU) in
``$TORCH_EXTENSIONS_DIR/<op>/``, guarded by a file ``lock`` that the building process creates and holds open until the
build is done. A build that is killed midway (a rank killed, Ctrl-C during the first launch) leaves the file, and every
later process waits on it forever without a word. By default the directory is user-wide, so two environments (two
clones' `.venv`) also rewrite each other's `build.ninja` and rebuild the op.

`prepare_op_builds` (run before any process group starts: `process_setup.prepare_process`) gives each Python environment
its own directory, unless the user set ``TORCH_EXTENSIONS_DIR``, and removes a lock that no process on this machine
holds open, saying so in one line. Where it cannot tell (no ``/proc``, or a network filesystem that a build on another
machine may be writing) it names the file once and leaves it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from pathlib import Path

ENV = "TORCH_EXTENSIONS_DIR"
LOCK = "lock"  # torch.utils.file_baton.FileBaton's file, in each op's build directory
# Filesystems that several machines share: a lock there may be held by a build on another machine
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "afs", "panfs")
_RECHECK_S = 0.2
_CHECK_FILE = ".trl_distill_lock_check"  # serialises the check between processes starting together


def default_root() -> Path:
    """The user-wide directory torch uses when ``TORCH_EXTENSIONS_DIR`` is unset (as
    `cpp_extension.get_default_build_root` finds it, without importing that module: it pulls in setuptools)."""
    if sys.platform == "darwin":
        cache = Path.home() / "Library" / "Caches"
    elif sys.platform == "win32":
        cache = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "torch_extensions"


def own_build_dir() -> Path:
    """This environment's build directory: torch's default folder name (Python version and accelerator) plus a hash of
    the environment's prefix, under torch's user-wide root."""
    import torch.version

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    env = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:10]
    return default_root() / f"{python}_{accelerator}-env-{env}"


def build_root() -> Path:
    """Where ops are built now: ``TORCH_EXTENSIONS_DIR`` if set, else this environment's own directory."""
    return Path(os.environ[ENV]) if os.environ.get(ENV) else own_build_dir()


def prepare_op_builds() -> list[str]:
    """Point torch at this environment's build directory (a ``TORCH_EXTENSIONS_DIR`` the user set is kept), then deal
    with stale locks there (`clear_stale_locks`). Returns the lines written to stderr."""
    if not os.environ.get(ENV):
        os.environ[ENV] = str(own_build_dir())
    return clear_stale_locks(build_root())


def clear_stale_locks(root: Path, write=None) -> list[str]:
    """Remove each ``<root>/<op>/lock`` that no process on this machine holds open, one line each on stderr. A lock
    that may be held elsewhere (a network filesystem) or whose holders cannot be seen (no ``/proc``) is named once
    and left. Processes starting together check one at a time, so a lock that a build has just created is never
    taken for a stale one."""
    write = write or _stderr
    locks = sorted(root.glob(f"*/{LOCK}")) if root.is_dir() else []
    if not locks:
        return []
    lines = []
    with _checking(root):
        for lock in locks:
            line = _deal_with(lock)
            if line:
                write(line)
                lines.append(line)
    return lines


def describe_locks(root: Path | None = None) -> list[str]:
    """One line per build lock under `root` (default `build_root`): its path, age and who holds it open. For a
    message about processes that did not start."""
    import time

    root = root or build_root()
    lines = []
    for lock in sorted(root.glob(f"*/{LOCK}")) if root.is_dir() else []:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:
            continue
        holders = lock_holders(lock)
        who = ("holders unknown (no /proc)" if holders is None else
               f"held open by process {', '.join(map(str, holders))}" if holders else "held by no process: stale")
        lines.append(f"{lock} ({age:.0f} s old, {who})")
    return lines


def lock_holders(lock: Path) -> list[int] | None:
    """The ids of the processes on this machine that have `lock` open (the build holding it), or None where
    ``/proc`` cannot tell."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    holders = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) == target:
                        holders.append(int(entry.name))
                        break
    return holders


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it in ``/proc/mounts``)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), "", None
    for mount in mounts:
        fields = mount.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def _deal_with(lock: Path) -> str | None:
    holders = _settled_holders(lock)
    if holders is _GONE or holders:
        return None  # released meanwhile, or a build on this machine holds it: torch waits for it, as it should
    op = lock.parent.name
    if holders is None or filesystem_type(lock) in NETWORK_FILESYSTEMS:
        where = "no /proc to see who holds it" if holders is None else "it is on a network filesystem"
        return (f"trl-distill: the build of {op} waits on {lock} ({where}); if no build of it is running, on this "
                "machine or another, delete that file.")
    try:
        lock.unlink()
    except FileNotFoundError:
        return None  # its build finished meanwhile
    except OSError as error:
        return f"trl-distill: {lock} is a stale build lock but cannot be removed ({error.strerror}); delete it."
    return (f"trl-distill: removed a stale build lock, {lock}: a build of {op} was stopped midway and no process "
            "holds it; the op is built again.")


_GONE = object()


def _settled_holders(lock: Path):
    """`lock_holders`, asked twice a moment apart about the same file: torch closes the lock before it removes it, and
    a lock seen in between is not stale. `_GONE` if the file went away or was replaced."""
    import time

    try:
        first = lock.stat().st_ino
    except OSError:
        return _GONE
    holders = lock_holders(lock)
    if holders:
        return holders
    time.sleep(_RECHECK_S)
    try:
        if lock.stat().st_ino != first:
            return _GONE
    except OSError:
        return _GONE
    return lock_holders(lock)


@contextlib.contextmanager
def _checking(root: Path):
    """An exclusive `flock` on a file in `root` for the time of the check (released if the process dies)."""
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        yield
        return
    try:
        handle = open(root / _CHECK_FILE, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
