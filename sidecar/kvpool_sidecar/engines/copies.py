"""The worker's copy lanes: transfers run off the engine's forward thread, one job at a time per lane, in
the order they were submitted (a CUDA stream's semantics), and each job's future completes when its
bytes are in place. The worker keeps two lanes: the step's loads (layer by layer, waited for by each
attention layer before it reads) and the saves (reported once written), so that a load never queues
behind an earlier step's saves.

On CPU one thread runs a lane's jobs: torch's gathers and scatters release the GIL, so they overlap
the engine's forward. On CUDA the same thread issues each job on a copy stream of its own, after an
event recorded on the engine's stream when the job was submitted (the forward that wrote the blocks
may still be running there), and waits for that stream before completing the future (also when the
job raised). Transfers between the device and the pool's host segment go through page-locked staging
buffers (the pool side is a host gather or scatter), so the segment itself is not registered with the
device. The CUDA calls of the engine path are here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class CopyQueue:
    def __init__(self, device: torch.device, name: str = "kvpool-copy") -> None:
        self.cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None
        # The lane's thread makes its CUDA calls on the engine's device (a thread's current device is
        # device 0 until set: a rank on another GPU would create a context there).
        init = (lambda: torch.cuda.set_device(device)) if self.cuda else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=init)

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` after every job submitted before it (and, on CUDA, after the work the engine has
        queued on its stream so far)."""
        if not self.cuda:
            return self._thread.submit(job)
        ready = torch.cuda.Event()
        ready.record()  # on the engine's current stream: the forward that wrote the blocks
        stream = self._stream

        def on_stream() -> T:
            try:
                with torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    return job()
            finally:  # also when the job raised: its future completes only once nothing of it runs
                stream.synchronize()

        return self._thread.submit(on_stream)

    def close(self) -> None:
        """Wait for every submitted job, then stop the thread."""
        self._thread.shutdown(wait=True)


def host_staging(rows: int, row_len: int, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """A host buffer for one transfer's gathered rows: page-locked beside a CUDA engine (so the transfer
    is asynchronous DMA; torch's host allocator caches these and keeps one alive until its copy is done)."""
    return torch.empty((rows, row_len), dtype=dtype, pin_memory=cuda)

