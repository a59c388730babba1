"""Run by test_vllm_engine's small-volume restart test in a mount namespace of its own whose /dev/shm is a
small tmpfs (the pod's memory volume, which vLLM's own shared-memory queues use too): a real vLLM engine
with KVPoolConnector beside a sidecar whose pool fills about two thirds of what the engine leaves free.
The sidecar is stopped (SIGTERM), then killed -9; each time it restarts in the same volume, and the
engine saves through it and loads back what it saved, with the tokens vLLM computes alone. Exits
non-zero, with the reason, on any failure."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from engine_support import BLOCK, SidecarProcess, generate, make_engine, prompt
from kvpool_sidecar.storage import ModelShape
from tiny_model import build_tiny_model


def shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def main() -> None:
    folder = Path(sys.argv[1])
    model = build_tiny_model(folder / "model")
    sidecar = SidecarProcess(folder, pages=8)  # the engine first, to learn what its own segments take
    sidecar.start()
    llm = make_engine(model, sidecar.socket)
    handle = sidecar.get("/v1/storage/handle")
    page_bytes = ModelShape(**handle["shape"]).bytes_per_page(handle["page_size"])
    sidecar.pages = int(shm_free() * 2 / 3) // page_bytes
    sidecar.terminate()  # beside the engine: the restart takes the segment over, grown to the large pool
    sidecar.start()
    assert shm_free() < sidecar.pages * page_bytes, "the pool should fill most of the volume"
    try:
        for n, how in enumerate((None, signal.SIGTERM, signal.SIGKILL)):
            if how is not None:
                os.kill(sidecar.proc.pid, how)  # the engine keeps its mapping of the old pool
                sidecar.proc.wait()
                sidecar.proc = None
                sidecar.start()  # a pool of the same size must start in the same volume
            first = prompt(700 + n, 10 * BLOCK + 5)
            second = first[: 10 * BLOCK] + prompt(800 + n, 9)
            baseline, _ = generate(llm, second, fresh=True)
            deadline = time.monotonic() + 60  # the link's reconnect and the worker's remap
            while True:
                generate(llm, first)  # computed and saved in the pool
                tokens, from_pool = generate(llm, second)
                assert tokens == baseline, f"after {how}: tokens differ from vLLM's alone"
                if from_pool >= 10 * BLOCK:
                    break
                assert time.monotonic() < deadline, f"after {how}: the engine never loaded from the restarted sidecar"
                time.sleep(0.2)
    finally:
        llm.llm_engine.engine_core.shutdown()
        sidecar.stop()
    print("restarted and served")


if __name__ == "__main__":
    main()
