"""Run by test_vllm_tier_restarts in a mount namespace of its own whose /dev/shm is a small tmpfs (the
pod's memory volume): vLLM's tiering manager with KVPoolTier (its primary region in the same volume)
beside a sidecar whose pool fills about two thirds of it. The sidecar is stopped (SIGTERM), then killed
-9; each time it restarts, and the tier stores through it and loads back the very bytes it stored. Exits
non-zero, with the reason, on any failure."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from engine_support import SidecarProcess
from test_vllm_tier import CHUNK, KV_SHAPE, keys, loaded_bytes, lookups, manager, shipped_tier, steps_until, store
from vllm.v1.kv_offload.base import LookupResult, ReqContext


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def round_trip(one, two, tag: str, fill: int) -> bool:
    """Engine one stores two chunks; engine two (its own primary region) promotes them from kvpool: True
    once the bytes one wrote came back."""
    ks = keys(tag, 2)
    store(one, f"{tag}-s", ks, fill)
    try:
        steps_until(one, lambda: not one.has_pending_work(), "the store was never reported", timeout=5)
    except AssertionError:
        return False
    ctx = ReqContext(f"{tag}-l")
    two.on_new_request(ctx)
    try:
        if lookups(two, ctx, ks, timeout=5) != [LookupResult.HIT] * 2:
            return False
        return loaded_bytes(two, ctx, ks) == [fill, fill + 1]
    finally:
        two.on_request_finished(ctx)


def main() -> None:
    pages, folder = int(sys.argv[1]), Path(sys.argv[2])
    sidecar = SidecarProcess(folder, pages=pages, kv_shape=KV_SHAPE,
                             config={"pageSize": shipped_tier()[0]["block_size"], "eviction": {"policy": "lru"},
                                     "pinning": {"autoPin": {"enabled": False}}})
    sidecar.start()
    one_pool = shm_used()
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    assert one_pool > free, f"the pool ({one_pool} bytes) should fill most of the volume ({free} free)"
    one, two = manager("shm1", sidecar), manager("shm2", sidecar)
    try:
        assert round_trip(one, two, "before", 3), "the first sidecar served no round trip"
        for n, how in enumerate((signal.SIGTERM, signal.SIGKILL)):
            os.kill(sidecar.proc.pid, how)  # the tier keeps its mapping of the old pool
            sidecar.proc.wait()
            sidecar.proc = None
            sidecar.start()  # a pool of the same size must start
            assert shm_used() < one_pool * 1.5, f"after {how.name}: two pools' worth of the volume in use"
            deadline = time.monotonic() + 60  # the link's backoff and the lane's remap
            while not round_trip(one, two, f"after{n}-{int(time.monotonic() * 1000)}", 20 + 10 * n):
                assert time.monotonic() < deadline, f"after {how.name}: the tier never stored and loaded again"
                time.sleep(0.2)
    finally:
        one.shutdown()
        two.shutdown()
        sidecar.stop()
    print(f"restarted and served ({CHUNK} bytes a chunk)")


if __name__ == "__main__":
    main()
