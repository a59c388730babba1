"""kvpool's tier as KV events, without an engine: the connector's bookkeeping (what it announced), the
sidecar's removal feeds and the order in which a live sidecar's replies turn into stores and removals
(the real engine and vLLM's ZMQ stream are in tests/e2e/test_vllm_kv_events.py)."""

from __future__ import annotations

import time

from kvpool_sidecar import wire
from kvpool_sidecar.engines.link import SidecarLink
from kvpool_sidecar.routing.kv_events import EventLog, Removed, Stored
from kvpool_sidecar.service.removals import RemovalFeed
from support import LongSteps
from test_engine_connector import PS, hashes, save_whole, settle, sidecar_with_channel


def hello(events: bool, model: str = "m", session: str = "s1") -> wire.Hello:
    return wire.Hello(wire.PROTOCOL, "scheduler", session, model, None, events)


def test_the_log_removes_only_what_it_announced_and_announces_held_pages_once():
    log = EventLog()
    hs = hashes(4)
    log.stored(hs, 0, 2, "req")
    log.removed([hs[1], b"never-announced"])
    log.held(hs, 3, "req2")  # block 0 announced already: blocks 1-2 form one announcement after it
    log.held(hs, 3, "req3")  # nothing new
    assert log.take() == [Stored(hs[:2], None, 0, "req"), Removed([hs[1]]), Stored(hs[1:3], hs[0], 1, "req2")]
    log.forget_all()
    log.forget_all()  # once: nothing is left to remove
    assert log.take() == [Removed([hs[0], hs[1], hs[2]])]
    assert len(log) == 0


def test_a_feed_keeps_its_models_hashes_and_reports_a_loss_past_its_bound():
    feed = RemovalFeed(b"NS", limit=3)
    feed.add([b"NSa", b"XXb", ("token", "key"), b"NSc"])
    assert feed.take() == ([b"a", b"c"], False)
    feed.add([b"NS1", b"NS2", b"NS3", b"NS4"])
    assert feed.take() == ([], True)  # lost: the connector stops counting what it announced
    assert feed.take() == ([], False)


def wait_events(log: EventLog, want: int, timeout: float = 5.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < want:
        assert time.monotonic() < deadline, out
        out += log.take()
        time.sleep(0.01)
    return out


def test_commits_and_evictions_reach_the_connector_in_the_order_the_pool_saw_them():
    path, live = sidecar_with_channel(pages=8)
    with live as (_, sidecar):
        log = EventLog()
        side = LongSteps(SidecarLink(path, hello(True), events=log), PS, session="s1", lookup_wait=0.5)
        # A session of the same model without events, and another model's session with them.
        quiet = LongSteps(SidecarLink(path, hello(False, session="s2")), PS, session="s2", lookup_wait=0.5)
        other = EventLog()
        other_link = SidecarLink(path, hello(True, model="other", session="s3"), events=other)
        a, b = hashes(5, "a"), hashes(6, "b")
        save_whole(side, "r1", a, 5 * PS + 1, list(range(6)))
        assert wait_events(log, 1) == [Stored(a, None, 0, None)]
        save_whole(quiet, "r2", b, 6 * PS + 1, list(range(7)))  # 6 pages of 8: evicts a's last pages
        settle(quiet.link, sidecar)
        evicted = int(sidecar.metrics.registry.get_sample_value(
            "kvpool_evicted_pages_total", {"partition": "toC", "reason": "capacity"}))
        assert evicted == 3  # 6 pages wanted, 3 free
        [removal] = wait_events(log, 1)  # the idle link's next step brings them
        assert isinstance(removal, Removed) and sorted(removal.hashes) == sorted(a[5 - evicted:])
        # b's pages were stored by the quiet session: found held by this one, they are announced once.
        side.matched_tokens("r3", b, 6 * PS + 1, 0, None)
        assert wait_events(log, 1) == [Stored(b, None, 0, None)]
        side.finished("r3")
        time.sleep(1.2)  # idle steps: nothing more for this session, nothing of this model for the other
        assert log.take() == [] and other.take() == []
        for link in (side.link, quiet.link, other_link):
            link.close()
