"""What publishing kvpool's tier as KV events costs the engine per request, measured on the connector's own
code (instructions do not drift with a noisy machine the way a served benchmark's throughput does).

    .venv/bin/python bench/measurements/kv_events_cost.py                      # 20-block prompts
    .venv/bin/python bench/measurements/kv_events_cost.py --blocks 60 --repeat 2000

Per request on the engine's scheduler thread, with ``kv_events: true``: the connector's bookkeeping of
the commit (:class:`~kvpool_sidecar.routing.kv_events.EventLog`), one ``BlockStored`` of all its blocks
and, later, one ``BlockRemoved`` of them (the worst case: every page it stored is evicted), built by
``take_events`` as vLLM's own types (hash conversion, extra keys, token ids), and vLLM's publisher's
msgpack encoding of the batch. Prints microseconds per request and the share of a request's time at a
given throughput (``--rps``: what the served benchmark measured).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from types import SimpleNamespace


def main(argv: list[str] | None = None) -> int:
    import msgspec
    from kvpool_sidecar.engines.link import Report
    from kvpool_sidecar.engines.vllm import KVPoolConnector
    from kvpool_sidecar.routing.kv_events import EventLog
    from vllm.distributed.kv_events import KVEventBatch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=20, help="full blocks per prompt")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5000)
    ap.add_argument("--rps", type=float, default=35.0, help="requests/s of the engine (for the share)")
    args = ap.parse_args(argv)
    bs, n = args.block_size, args.blocks
    log = EventLog()
    report = Report()
    fake = SimpleNamespace(block_size=bs, _scheduler=SimpleNamespace(
        events=log, link=SimpleNamespace(record=lambda update: update(report))))
    fake._block_stored = lambda event: KVPoolConnector._block_stored(fake, event)
    encode = msgspec.msgpack.Encoder().encode
    requests = []
    for r in range(args.repeat):
        tokens = [(r * 7919 + i) % 50_000 for i in range(n * bs + 7)]
        hashes = [hashlib.sha256(f"{r}:{i}".encode()).digest() for i in range(n)]
        requests.append((SimpleNamespace(all_token_ids=tokens, mm_features=[], lora_request=None, cache_salt=None,
                                         prompt_embeds=None), hashes))
    start = time.perf_counter()
    for request, hashes in requests:
        log.stored(hashes, 0, n, request)
        batch = KVEventBatch(ts=time.time(), events=list(KVPoolConnector.take_events(fake)))
        encode(batch)
        log.removed(hashes)
        batch = KVEventBatch(ts=time.time(), events=list(KVPoolConnector.take_events(fake)))
        encode(batch)
    per_request = (time.perf_counter() - start) / args.repeat
    assert report.events == {"stored": n * args.repeat, "removed": n * args.repeat}
    print(f"{n} blocks of {bs} tokens: {per_request * 1e6:.1f} us per request (stored + removed + encoded); "
          f"at {args.rps:g} requests/s that is {100 * per_request * args.rps:.2f} % of one core's time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
