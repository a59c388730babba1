"""The pool's segment as a file: its name, its takeover by the next run of a named instance, the
resource tracker kept off it, and the writers' slot locks (:mod:`.tensors` lays the pool out in it).

A named instance's segment outlives its sidecar's exit while an engine maps it (a SIGKILL leaves it in
any case): tmpfs frees its pages only when the last mapping goes, so a successor that allocated a second
segment beside it might not fit the volume. The next run takes the same file over instead.

The writers' locks are open-file-description locks (``F_OFD_SETLK``) on byte ``slot`` of the file: a
lock belongs to the open file description that took it and the kernel drops it when that description is
closed, whatever ends the process (exit, SIGKILL, OOM); two descriptions in one process never merge or
drop each other's locks. A writer takes a shared lock; the sidecar only tests for one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import sys
from multiprocessing import resource_tracker, shared_memory

from kvpool_sidecar.storage import memory

SHM_DIR = "/dev/shm"
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (l_type, l_whence, l_start, l_len, l_pid): Linux, 64-bit


def set_lock(fd: int, kind: int, slot: int) -> None:
    """Take (waiting for none: writers share, the sidecar only tests) or drop the lock on byte ``slot``."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(kind, os.SEEK_SET, slot, 1, 0))


def lock_held(fd: int, start: int, length: int) -> bool:
    """Whether any open file description holds a lock on bytes ``start .. start + length`` of the file."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    return _FLOCK.unpack(answer)[0] != fcntl.F_UNLCK


def open_segment(instance: str | None, nbytes: int, pages: int,
             epoch: int) -> tuple[shared_memory.SharedMemory, bool, bool]:
    """The pool's segment, its pages allocated: a named instance's predecessor's when one was left
    behind, else a new one; whether this process's resource tracker owns it; whether it was taken over."""
    prefix = f"kvpool-{instance}-" if instance else "kvpool-"
    stale = take_over_stale_segment(prefix, nbytes, pages) if instance else None
    if stale is not None:
        return stale, False, True
    memory.check_fits(nbytes, memory.shm_free_bytes(SHM_DIR), memory.cgroup_room(), pages)
    shm = shared_memory.SharedMemory(create=True, size=nbytes, name=f"{prefix}{epoch:x}")
    try:
        memory.reserve(shm_path(shm), nbytes)  # zeros, not written
    except memory.PoolDoesNotFit:
        shm.close()
        shm.unlink()
        raise
    if instance:  # left behind by any exit, for the restart to take over: not the tracker's to unlink
        untrack(shm)
    return shm, not instance, False


def release_instance(instance: str, prefix: str | None = None) -> None:
    """Remove the segments an exit of the named ``instance`` (of every instance whose segments start with
    ``prefix``) left behind, for a tool or a test that ran a sidecar and is done with it; a segment a
    sidecar or an engine still holds (any lock on its file) is left alone."""
    prefix = prefix or f"kvpool-{instance}-"
    for name in os.listdir(SHM_DIR):
        if not name.startswith(prefix):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            if lock_held(fd, 0, 1 << 62):
                continue
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def take_over_stale_segment(prefix: str, nbytes: int, pages: int) -> shared_memory.SharedMemory | None:
    """The segment an earlier run of this instance left (a SIGKILL leaves it, a SIGTERM while an engine
    maps it), grown to ``nbytes`` (never shrunk) and its pages allocated, for the caller to stamp with its own epoch;
    None when there is none. Any others are unlinked. An engine still mapping the old pool shares the
    file's pages instead of holding a second copy of them in the shm volume; its next job names the new
    epoch and remaps."""
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except OSError:
        return None
    for name in names[1:]:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, name))
    if not names:
        return None
    path = os.path.join(SHM_DIR, names[0])
    try:
        grow = nbytes - os.stat(path).st_size
        if grow > 0:  # a larger pool than before: the growth must fit beside what the file holds
            memory.check_fits(grow, memory.shm_free_bytes(SHM_DIR), memory.cgroup_room(), pages)
            os.truncate(path, nbytes)
        # Never shrunk: an engine still mapping the old pool, mid-slice, would SIGBUS past a new end (a
        # smaller pool uses the file's first bytes until no engine maps it and a restart makes a new one).
        memory.reserve(path, nbytes)
        return open_untracked(names[0])
    except FileNotFoundError:
        return None


def shm_path(shm: shared_memory.SharedMemory) -> str:
    return os.path.join(SHM_DIR, shm.name.lstrip("/"))


def open_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without adopting: before Python 3.13 the attaching process's resource tracker would
    unlink the sidecar's segment when the engine exits."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    shm = shared_memory.SharedMemory(name=name)
    untrack(shm)
    return shm


def untrack(shm: shared_memory.SharedMemory) -> None:
    """Take a segment off this process's resource tracker, which would unlink it when the process dies
    (a SIGKILL included: the tracker is a process of its own)."""
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    if hasattr(shm, "_track"):  # Python 3.13: its unlink() would unregister it again
        shm._track = False


def unlink(shm: shared_memory.SharedMemory, tracked: bool) -> None:
    """Unlink a segment (``SharedMemory.unlink`` also unregisters it, which the tracker of an untracked
    one answers with an error on stderr)."""
    if tracked or hasattr(shm, "_track"):
        shm.unlink()
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shm_path(shm))
