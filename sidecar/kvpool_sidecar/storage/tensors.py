"""The pool's pages as one torch tensor, shareable with the inference engine's process.

Handshake (the engine's side is :meth:`KVStorage.attach`):

1. The sidecar allocates the pool and serves ``GET /v1/storage/handle``: a JSON handle with the
   shape, dtype, page size, the sharing mechanism and the pool's *epoch* (a random 64-bit number
   drawn at allocation).
2. The engine attaches: on CPU it maps the named POSIX shared-memory segment (on CUDA it would open
   a CUDA IPC handle: not built yet). Both sides then address the same bytes; page ids from the pool
   API index it.
3. The segment starts with a header holding a magic number and the epoch. A sidecar restart makes a
   new pool with a new epoch: an engine that attaches with an old handle, or whose mapping outlived the
   pool, gets :class:`StaleHandle` and must fetch a new handle (its cached pages are gone with the old
   pool anyway). A restart of a named instance takes over its killed predecessor's segment (the same
   file, a new epoch in its header) rather than allocating a second one beside it: an engine still
   mapping the old pool keeps its pages allocated in the shm volume, and a second segment might not
   fit there until that engine lets go, which it does only once a sidecar answers it.
4. After the epoch, the header holds one *fence* word per engine session (:data:`FENCE_SLOTS`): the
   sidecar writes a session's word when the session starts and clears it the moment the session's
   connection ends, and every copy the session's engine planned names its word and value. A load
   checks them after it has read (what it read is used only if the session still stood).
5. Writers announce their writes. Every write into the segment is a *slice* (a layer of a step's pages,
   or at most :data:`SLICE_BYTES` of a tier's store) made under :meth:`AttachedKV.writing`: the writer
   takes a shared lock on its session's slot (an open-file-description lock on byte ``slot`` of the
   segment's file, which the kernel drops whatever ends the writer's process: exit, SIGKILL, OOM), *then*
   checks the epoch and its fence, writes, and unlocks. The sidecar clears a session's fence, then
   hands the session's pages on only once no lock is held on its slot (:meth:`KVStorage.writers_on`),
   and a restart that takes over a segment stamps its new epoch, then waits until no lock is held at
   all before it serves (:data:`TAKEOVER_WAIT`). The lock and the check are ordered through the kernel's
   lock table, so either the sidecar sees the writer's lock and waits for the slice, or the writer sees
   the cleared fence and refuses the write: no write of an ended session lands in a page handed on,
   however long its thread was stalled between its check and its write.
6. Every engine's mapping holds a shared lock on byte :data:`MAPPED_BYTE` for as long as it maps the
   pool, and the sidecar one on :data:`OWNER_BYTE` while it runs (a segment with no lock held is a
   leftover, :func:`.segment.release_instance`). A sidecar that stops (SIGTERM) leaves its segment,
   stamped with a dead epoch, while any engine holds it, for its next run to take over, and unlinks it
   otherwise; after a SIGKILL there is no clean-up, and the next run takes the segment over.

The layout is versioned: :data:`LAYOUT` is in the magic number and in every handle, and any change to
the header or to how pages are laid out changes it (and the channel's ``wire.PROTOCOL``), so that an
engine built for another layout is refused by name rather than mapping the pool at the wrong offsets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

from kvpool_sidecar.storage import memory, reference, segment
from kvpool_sidecar.storage.backend import Backend, choose_backend

LAYOUT = 2  # the segment's layout version: 2 added the writers' slot locks (1: fences checked, no locks)
MAGIC_BASE = 0x4B56504F4F4C3030  # "KVPOOL00": the layout version is added to its last byte
MAGIC = MAGIC_BASE + LAYOUT  # "KVPOOL02"
HEADER = struct.Struct("<QQ")  # magic, epoch
HEADER_BYTES = memory.SEGMENT_HEADER_BYTES  # keeps the data 4 KiB aligned
FENCE = struct.Struct("<Q")
FENCE_OFFSET = 64
FENCE_SLOTS = (HEADER_BYTES - FENCE_OFFSET) // FENCE.size  # engine sessions live at once
# A tier's store is written in slices of at most this many bytes, each under its own lock and check: the
# longest a dead session's writer can keep its pages from being handed on is one slice's copy (about
# 10 ms at memory speed), not a whole job's.
SLICE_BYTES = 32 << 20
# Seconds a restart that took over a segment waits for the previous pool's writers to finish their
# slice before it refuses to start: a slice takes milliseconds, so a lock held this long is a writer
# stopped mid-copy (SIGSTOP, swapped out), and serving its pages could let its write land in them.
TAKEOVER_WAIT = 10.0
MAPPED_BYTE = FENCE_SLOTS  # the lock every engine's mapping holds (the slots' locks are bytes 0 .. FENCE_SLOTS - 1)
OWNER_BYTE = FENCE_SLOTS + 1  # the lock the sidecar that owns the pool holds while it runs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
if hasattr(torch, "float8_e4m3fn"):
    DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn


class StaleHandle(RuntimeError):
    """The handle names a pool that no longer exists (the sidecar restarted): fetch a new one."""


class Fenced(StaleHandle):
    """The session that planned a copy has ended: its pages may belong to another writer by now."""


class NoFenceSlot(RuntimeError):
    """Every fence word is held by a live engine session."""


class WritersStillActive(RuntimeError):
    """A writer of the pool this sidecar took over is still in the middle of a slice."""


class LayoutMismatch(StaleHandle):
    """The segment or the handle has another layout version than this code's (the message names both)."""


@dataclass(frozen=True)
class ModelShape:
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.torch_dtype.itemsize

    def bytes_per_page(self, page_size: int) -> int:
        return self.bytes_per_token() * page_size


class KVStorage:
    """``kv[page, layer, k_or_v, slot, kv_head, head_dim]`` on CUDA when available, else CPU."""

    def __init__(
        self,
        shape: ModelShape,
        page_size: int,
        *,
        pages: int | None = None,
        memory_bytes: int | None = None,
        device: str | None = None,
        backend: str | None = None,
        shared: bool = False,
        instance: str | None = None,
        takeover_wait: float = TAKEOVER_WAIT,
    ) -> None:
        if (pages is None) == (memory_bytes is None):
            raise ValueError("give exactly one of pages or memory_bytes")
        self.shape = shape
        self.page_size = page_size
        if pages is None:
            assert memory_bytes is not None
            pages = memory_bytes // shape.bytes_per_page(page_size)
        if pages < 1:
            raise ValueError("the budget does not hold a single page")
        self.num_pages = pages
        if shared and device not in (None, "cpu"):
            raise ValueError(f"a shared pool lives in host memory (the engine maps it): device {device!r} is not cpu")
        # A shared pool is host memory even beside a GPU: the engine's workers map it and copy to their device.
        self.device = torch.device("cpu" if shared else device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.backend = choose_backend(self.device, backend)
        self.epoch = secrets.randbits(63)
        dims = (pages, shape.layers, 2, page_size, shape.kv_heads, shape.head_dim)
        self._shm: shared_memory.SharedMemory | None = None
        self._tracked = True  # the segment is this process's resource tracker's to unlink if it dies
        self._fences: dict[int, int] = {}  # slot -> the value a live session's copies name
        self._fence_serial = secrets.randbits(62)  # values differ from a predecessor's, whose engines may live
        self._locks: int | None = None  # a descriptor of the segment's file, to test the writers' locks
        if shared and self.device.type == "cpu":
            nbytes = memory.segment_bytes(shape.bytes_per_page(page_size), pages)
            self._shm, self._tracked, taken_over = segment.open_segment(instance, nbytes, pages, self.epoch)
            self._shm.buf[FENCE_OFFSET:HEADER_BYTES] = bytes(HEADER_BYTES - FENCE_OFFSET)  # no session yet
            HEADER.pack_into(self._shm.buf, 0, MAGIC, self.epoch)  # from here every old writer refuses
            self._locks = os.open(segment.shm_path(self._shm), os.O_RDWR)
            segment.set_lock(self._locks, fcntl.F_RDLCK, OWNER_BYTE)  # in use: never released as a leftover
            if taken_over:
                try:
                    self._await_old_writers(takeover_wait)
                except WritersStillActive:
                    self.close()
                    raise
            self.kv = _tensor_on(self._shm, dims, shape.torch_dtype)
        else:
            self.kv = torch.zeros(dims, dtype=shape.torch_dtype, device=self.device)
        self._kernels: Any = reference
        if self.backend is not Backend.TORCH:
            from kvpool_sidecar.storage import kernels

            self._kernels = kernels

    # ------------------------------------------------------------------------------- reporting
    def describe(self) -> dict[str, Any]:
        return {
            "storage": "torch",
            "device": str(self.device),
            "kernels": self.backend.value,
            "pages": self.num_pages,
            "bytes_per_page": self.shape.bytes_per_page(self.page_size),
            "bytes_per_token": self.shape.bytes_per_token(),
            "shared": self._shm is not None or self.device.type == "cuda",
            "epoch": self.epoch,
        }

    # --------------------------------------------------------------------------------- moving
    def _ids(self, ids: Any) -> torch.Tensor:
        t = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_pages):
            raise IndexError(f"page ids must be in [0, {self.num_pages})")
        return t

    def write_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: Any) -> None:
        """KV of new tokens of ``layer`` into their slots (``page * page_size + offset``, -1 skips)."""
        if not 0 <= layer < self.shape.layers:
            raise IndexError(f"layer must be in [0, {self.shape.layers})")
        slots_t = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        if slots_t.numel() and int(slots_t.max()) >= self.num_pages * self.page_size:
            raise IndexError("a slot is past the last page")
        self._kernels.write_kv(self.kv, layer, key.to(self.device, self.kv.dtype), value.to(self.device, self.kv.dtype),
                               slots_t)

    def copy_pages(self, src: Any, dst: Any) -> None:
        self._kernels.copy_pages(self.kv, self._ids(src), self._ids(dst))

    def gather_pages(self, pages: Any, pin_host: bool = False) -> torch.Tensor:
        """Pages packed into one contiguous [n, page_elements] buffer; on the host (pinned when CUDA
        is present) with ``pin_host``, for offload or transfer to another pod."""
        out = self._kernels.gather_pages(self.kv, self._ids(pages))
        if pin_host and self.device.type == "cuda":
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=False)
            return host
        return out

    def scatter_pages(self, pages: Any, buffer: torch.Tensor) -> None:
        ids = self._ids(pages)
        row = self.kv[0].numel()
        if buffer.numel() != len(ids) * row:
            raise ValueError(f"buffer holds {buffer.numel()} elements, {len(ids)} pages need {len(ids) * row}")
        if buffer.dtype != self.kv.dtype:
            raise TypeError(f"buffer dtype {buffer.dtype} is not the pool's {self.kv.dtype}")
        self._kernels.scatter_pages(self.kv, ids, buffer.to(self.device).view(len(ids), row))

    # --------------------------------------------------------------------------------- fences
    def open_fence(self) -> tuple[int, int] | None:
        """A fence word for a new engine session: (slot, value), the value never used before in this
        pool; None for a pool no engine maps."""
        if self._shm is None:
            return None
        slot = next((i for i in range(FENCE_SLOTS) if self._free_slot(i)), None)
        if slot is None:
            raise NoFenceSlot(f"{FENCE_SLOTS} engine sessions are connected: no fence word is free")
        self._fence_serial += 1
        self._fences[slot] = self._fence_serial
        FENCE.pack_into(self._shm.buf, FENCE_OFFSET + slot * FENCE.size, self._fence_serial)
        return slot, self._fence_serial

    def close_fence(self, fence: tuple[int, int] | None) -> None:
        """The session ended: from now on every slice it starts is refused by its writer (the word is
        cleared before this returns). Its pages may be handed on once :meth:`writers_on` its slot is
        False; the slot is reused only then, by a session whose value differs."""
        if fence is None or self._shm is None or self._fences.get(fence[0]) != fence[1]:
            return
        FENCE.pack_into(self._shm.buf, FENCE_OFFSET + fence[0] * FENCE.size, 0)
        del self._fences[fence[0]]

    def ended_writers_on(self, slot: int) -> bool:
        """Whether a writer of the ended session that held fence slot ``slot`` may still be mid-slice:
        False once the slot serves another session (it is reopened only when no lock is held on it after
        the clear, so every writer of the ended session was done or will be refused)."""
        return slot not in self._fences and self.writers_on(slot)

    def writers_on(self, slot: int) -> bool:
        """Whether a writer is in the middle of a slice under fence slot ``slot`` (it holds the slot's
        lock: it checked the fence before it was cleared, and its write may still land)."""
        return self._locks is not None and segment.lock_held(self._locks, slot, 1)

    def _free_slot(self, slot: int) -> bool:
        return slot not in self._fences and not self.writers_on(slot)

    def _await_old_writers(self, wait: float) -> None:
        """Until no writer of the pool this one took over holds a slot's lock (each was mid-slice, its
        check passed before the new epoch was stamped); :class:`WritersStillActive` after ``wait`` s."""
        assert self._locks is not None
        deadline = time.monotonic() + wait
        while segment.lock_held(self._locks, 0, FENCE_SLOTS):
            if time.monotonic() >= deadline:
                raise WritersStillActive(
                    f"a writer of the pool this sidecar took over is still in the middle of a copy after {wait:g} s "
                    "(an engine process stopped or swapped out mid-write): its write could land in pages this "
                    "sidecar would hand out, so it does not start; it starts once that writer's copy ends or its "
                    "process exits")
            time.sleep(0.005)

    # -------------------------------------------------------------------------------- sharing
    def handle(self) -> dict[str, Any]:
        """What another process needs to attach (JSON-serialisable)."""
        info: dict[str, Any] = {
            "shape": asdict(self.shape),
            "page_size": self.page_size,
            "pages": self.num_pages,
            "epoch": self.epoch,
            "layout": LAYOUT,
        }
        if self._shm is not None:
            info["kind"] = "shm"
            info["name"] = self._shm.name
        elif self.device.type == "cuda":  # pragma: no cover - needs a GPU
            raise NotImplementedError("CUDA IPC sharing is designed (see the module doc) but not built yet")
        else:
            raise RuntimeError("this pool was not allocated shared (shared=True)")
        return info

    @staticmethod
    def attach(handle: dict[str, Any]) -> AttachedKV:
        """Map the sidecar's pool in this process (the engine's side of the handshake)."""
        shape = ModelShape(**handle["shape"])
        dims = (handle["pages"], shape.layers, 2, handle["page_size"], shape.kv_heads, shape.head_dim)
        if handle.get("kind") != "shm":
            raise ValueError(f"cannot attach a {handle.get('kind')!r} handle here")
        if handle.get("layout") != LAYOUT:
            raise LayoutMismatch(f"the sidecar's pool has segment layout {handle.get('layout')}, this engine's "
                                 f"kvpool reads layout {LAYOUT}: run the same kvpool version on both sides")
        try:
            shm = segment.open_untracked(handle["name"])
        except FileNotFoundError:
            raise StaleHandle(
                f"pool {handle['name']} (epoch {handle['epoch']}) no longer exists: the sidecar restarted, "
                "fetch a new handle"
            ) from None
        attached = AttachedKV(shm, _tensor_on(shm, dims, shape.torch_dtype), handle["epoch"])
        try:
            attached.check()
        except BaseException:  # a pool restarted meanwhile: nothing of this mapping (its lock) stays
            attached.close()
            raise
        return attached

    def close(self) -> None:
        """Free the pool. A named instance's segment stays while an engine maps it (stamped with a dead
        epoch, for the next run of the instance to take over: tmpfs frees its pages only when the last
        mapping goes, so a successor that allocated a second segment might not fit); otherwise, and for
        an unnamed pool, it is unlinked."""
        if self._shm is not None:
            HEADER.pack_into(self._shm.buf, 0, MAGIC, 0)  # mappings still open see a dead epoch
            mapped = self._locks is not None and segment.lock_held(self._locks, MAPPED_BYTE, 1)
            if self._tracked or not mapped:  # first: the name goes even if a view of the tensor outlives this
                segment.unlink(self._shm, self._tracked)
        if self._locks is not None:
            os.close(self._locks)
            self._locks = None
        if self._shm is not None:
            if hasattr(self, "kv"):
                del self.kv
            try:
                self._shm.close()
            except BufferError:
                pass  # a view still holds the mapping; it is unmapped when the last view goes
            self._shm = None


class AttachedKV:
    """An engine's mapping of the sidecar's pool; :meth:`check` before using cached page ids, and write
    only within :meth:`writing`."""

    def __init__(self, shm: shared_memory.SharedMemory, kv: torch.Tensor, epoch: int) -> None:
        self._shm = shm
        self.kv = kv
        self.epoch = epoch
        # Its own open file description: a lock belongs to the description, so two mappings in one
        # process (or this one and the sidecar's) never merge or drop each other's locks.
        self.closed = False
        self._locks = os.open(segment.shm_path(shm), os.O_RDWR)
        try:
            segment.set_lock(self._locks, fcntl.F_RDLCK, MAPPED_BYTE)  # held while mapped (module doc, 6)
        except OSError:
            os.close(self._locks)
            raise
        self._writing = threading.Lock()  # one slice at a time through this mapping (the lock is per slot)

    @contextlib.contextmanager
    def writing(self, fence: tuple[int, int] | None) -> Iterator[None]:
        """One slice's right to write: the session's slot locked, *then* the pool and the fence checked
        (:class:`StaleHandle` / :class:`Fenced` when either moved: nothing is written), unlocked after the
        block. The sidecar hands the session's pages on only once the lock is free (module doc, 5)."""
        with self._writing:
            if fence is None:
                self.check(None)
                yield
                return
            segment.set_lock(self._locks, fcntl.F_RDLCK, fence[0])
            try:
                self.check(fence)
                yield
            finally:
                segment.set_lock(self._locks, fcntl.F_UNLCK, fence[0])

    def check(self, fence: tuple[int, int] | None = None) -> None:
        """Raise :class:`StaleHandle` unless this mapping's pool is the sidecar's live one and, given a
        session's ``fence`` (slot, value), :class:`Fenced` unless that session is still connected (and
        :class:`StaleHandle` once this mapping is closed: a job queued on it fails, it reads nothing)."""
        if self.closed:
            raise StaleHandle("this mapping of the pool was closed (its pool is gone): fetch a new handle")
        magic, epoch = HEADER.unpack_from(self._shm.buf, 0)
        if magic != MAGIC and magic & ~0xFF == MAGIC_BASE & ~0xFF:
            raise LayoutMismatch(f"the pool's segment has layout {(magic & 0xFF) - 0x30}, this engine's kvpool "
                                 f"reads layout {LAYOUT}: run the same kvpool version on both sides")
        if magic != MAGIC or epoch != self.epoch:
            raise StaleHandle(f"the pool's epoch is {epoch}, the handle's {self.epoch}: fetch a new handle")
        if fence is not None:
            slot, value = fence
            at = FENCE_OFFSET + slot * FENCE.size
            if not 0 <= slot < FENCE_SLOTS or FENCE.unpack_from(self._shm.buf, at)[0] != value:
                raise Fenced("the engine session that planned this copy has ended: its pages may be another "
                             "writer's by now")

    def close(self) -> None:
        """Unmap. torch's views hold no export of the buffer, so nothing may use :attr:`kv` after this:
        the worker and the tier close a mapping only after every copy queued on it."""
        if self.closed:
            return
        self.closed = True
        del self.kv
        os.close(self._locks)
        with contextlib.suppress(BufferError):
            self._shm.close()


def _tensor_on(shm: shared_memory.SharedMemory, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = 1
    for d in dims:
        count *= d
    flat = torch.frombuffer(shm.buf, dtype=dtype, count=count, offset=HEADER_BYTES)
    return flat.view(dims)
