"""The worker's copy queue: a step's saves run off the forward path, one job at a time, in the order
they were submitted (a CUDA stream's semantics), and each job's future completes when its bytes are in
place.

On CPU one thread runs the jobs: torch's gathers and scatters release the GIL, so a save overlaps the
engine's next step. On CUDA the same thread issues each job on a copy stream of its own, after an
event recorded on the engine's stream when the job was submitted (the forward that wrote the blocks
may still be running there), and waits for that stream before completing the future. The CUDA calls
of the engine path are here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class CopyQueue:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpool-copy")

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` after every job submitted before it (and, on CUDA, after the work the engine has
        queued on its stream so far)."""
        if not self.cuda:
            return self._thread.submit(job)
        ready = torch.cuda.Event()
        ready.record()  # on the engine's current stream: the forward that wrote the blocks
        stream = self._stream

        def on_stream() -> T:
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                out = job()
            stream.synchronize()
            return out

        return self._thread.submit(on_stream)

    def close(self) -> None:
        """Wait for every submitted job, then stop the thread."""
        self._thread.shutdown(wait=True)
