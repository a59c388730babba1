"""Hot reload: a changed config file (rewritten, or swapped by kubelet's ..data symlink) or a PUT is
applied in place within 2 s, without dropping cached pages; a bad one is refused and the old stays."""

from __future__ import annotations

import time

import httpx
import yaml
from kvpool_sidecar.client import SidecarClient
from support import kubelet_projection, live_sidecar

BASE = {"pageSize": 4, "eviction": {"policy": "workload_adaptive", "selfTuning": {"enabled": False}},
        "pinning": {"autoPin": {"enabled": False}}}  # weights as given: a reload's new weights are what rank


def with_weights(reuse: float, locality: float = 0.3) -> dict:
    return {**BASE, "eviction": {**BASE["eviction"], "weights": {"reuse": reuse, "locality": locality}}}


def wait_for(predicate, timeout: float = 2.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError("condition not met within the time limit")


def warm(c: SidecarClient, n: int, offset: int = 0) -> int:
    """Replay n two-turn chats; returns the tokens hit."""
    hits = 0
    for i in range(n):
        prompt = [1, 2, 3, 4] + [100 + offset + i] * 8
        for turn in (0, 1):
            seq = f"s{offset}-{i}-{turn}"
            hits += c.admit(seq, prompt + [turn] * 4, meta={"turn": turn}).num_cached_tokens
            c.commit(seq, len(prompt) + 4)
            c.release(seq)
    return hits


def test_rewritten_file_is_applied_in_place(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(with_weights(0.6)))
    with live_sidecar(config_path=path, pages=400) as (url, sidecar), SidecarClient(url) as c:
        warm(c, 10)
        cached = c.stats()["cached_pages"]
        path.write_text(yaml.safe_dump(with_weights(0.9, 0.05)))
        took = wait_for(lambda: c.config()["config"]["eviction"]["weights"]["reuse"] == 0.9)
        assert took < 2.0
        assert c.stats()["cached_pages"] == cached  # nothing flushed
        assert c.lookup([1, 2, 3, 4] + [100] * 8) == 12
        assert sidecar.pool.policies[0].weights == (0.9, 0.05)  # the live policy took the new weights
        assert c.config()["reloads"]["applied"] == 1


def test_kubelet_symlink_swap_is_applied(tmp_path):
    kubelet_projection(tmp_path, with_weights(0.6), 1)
    with live_sidecar(config_path=tmp_path / "config.yaml") as (url, _), SidecarClient(url) as c:
        kubelet_projection(tmp_path, {**with_weights(0.7), "source": {"name": "chat", "generation": 7}}, 2)
        wait_for(lambda: c.config()["generation"] == 7)
        assert c.config()["config"]["eviction"]["weights"]["reuse"] == 0.7
        assert 'kvpool_config_generation 7.0' in c.metrics()


def test_hit_ratio_continues_across_a_reload(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(with_weights(0.6)))
    with live_sidecar(config_path=path, pages=400) as (url, _), SidecarClient(url) as c:
        warm(c, 20)
        path.write_text(yaml.safe_dump(with_weights(0.8)))
        wait_for(lambda: c.config()["reloads"]["applied"] == 1)
        # The same chats come back after the reload: their first turns hit the pages cached before it.
        hits_after = 0
        for i in range(20):
            hits_after += c.admit(f"again{i}", [1, 2, 3, 4] + [100 + i] * 8 + [0] * 4).num_cached_tokens
            c.release(f"again{i}")
        assert hits_after == 20 * 16


def test_invalid_file_is_refused_and_the_old_config_stays(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(with_weights(0.6)))
    with live_sidecar(config_path=path) as (url, _), SidecarClient(url) as c:
        old_hash = c.config()["hash"]
        path.write_text("eviction: {weights: {reuse: 7}}\n")
        wait_for(lambda: c.config()["last_error"] is not None)
        view = c.config()
        assert view["hash"] == old_hash and view["config"]["eviction"]["weights"]["reuse"] == 0.6
        assert "eviction.weights.reuse" in view["last_error"]
        assert 'kvpool_config_reloads_total{result="invalid"} 1.0' in c.metrics()
        path.write_text(yaml.safe_dump({**BASE, "pageSize": 8}))
        wait_for(lambda: "restart" in (c.config()["last_error"] or ""))
        assert c.stats()["page_size"] == 4
        path.write_text(yaml.safe_dump(with_weights(0.5)))  # a good file clears the error
        wait_for(lambda: c.config()["last_error"] is None)
        assert c.config()["config"]["eviction"]["weights"]["reuse"] == 0.5


def test_put_config_validates_the_same_way(sidecar_url):
    url, _ = sidecar_url
    with SidecarClient(url) as c:
        view = c.put_config({**BASE, "eviction": {"policy": "lru"}, "workloads": {"toB": {"isolationPercent": 10}}})
        assert view["config"]["workloads"]["toB"]["isolationPercent"] == 10
        assert c.stats()["partitions"]["toB"]["capacity"] == 25
        r = httpx.put(url + "/v1/config", json={**BASE, "pinning": {"quotaPercent": 101}})
        assert r.status_code == 422 and r.json()["field"] == "pinning.quotaPercent"
        r = httpx.put(url + "/v1/config", json={**BASE, "pageSize": 16})
        assert r.status_code == 409 and r.json()["field"] == "pageSize" and "restart" in r.json()["detail"]
        assert c.config()["config"]["workloads"]["toB"]["isolationPercent"] == 10


def test_a_file_cut_short_or_emptied_is_refused_and_the_old_config_stays(tmp_path):
    from kvpool_operator.render import config_document
    from kvpool_sidecar.config import KVCachePolicySpec

    spec = KVCachePolicySpec.model_validate({**BASE, "pinning": {"quotaPercent": 10, "autoPin": {"enabled": False}}})
    full, digest = config_document("chat", "llm", 3, spec)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(BASE))
    with live_sidecar(config_path=path) as (url, _), SidecarClient(url) as c:
        path.write_text(full)
        wait_for(lambda: c.config()["hash"] == digest)
        lines = full.splitlines(keepends=True)
        cut = "".join(lines[: lines.index(next(x for x in lines if x.startswith("pinning:")))])
        assert yaml.safe_load(cut)["source"]["hash"] == digest  # still parses: defaults would fill the rest
        for broken, reason in ((cut, "source.hash"), ("", "empty")):
            before = c.config()["reloads"]["invalid"]
            path.write_text(broken)
            wait_for(lambda before=before: c.config()["reloads"]["invalid"] > before)
            view = c.config()
            assert view["hash"] == digest and view["config"]["pinning"]["quotaPercent"] == 10
            assert reason in view["last_error"]
        before = c.config()["reloads"]["invalid"]
        path.write_text(yaml.safe_dump(yaml.safe_load(full), default_flow_style=True))  # the same spec, laid out
        time.sleep(0.5)  # anew: fine again
        assert c.config()["hash"] == digest and c.config()["reloads"]["invalid"] == before


def test_file_events_apply_a_change_well_under_a_second(tmp_path):
    """The poll is set to 30 s here: only the file event (inotify) can apply the change in time."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(with_weights(0.6)))
    with live_sidecar(config_path=path, poll_interval=30.0) as (url, _), SidecarClient(url) as c:
        time.sleep(0.3)  # the watch is set up
        path.write_text(yaml.safe_dump(with_weights(0.9)))
        took = wait_for(lambda: c.config()["config"]["eviction"]["weights"]["reuse"] == 0.9, timeout=1.0)
        assert took < 1.0
    projected = tmp_path / "projected"
    projected.mkdir()
    kubelet_projection(projected, with_weights(0.6), 1)
    with live_sidecar(config_path=projected / "config.yaml", poll_interval=30.0) as (url, _), \
            SidecarClient(url) as c:
        time.sleep(0.3)
        kubelet_projection(projected, with_weights(0.7), 2)
        took = wait_for(lambda: c.config()["config"]["eviction"]["weights"]["reuse"] == 0.7, timeout=1.0)
        assert took < 1.0


def test_writes_beside_the_config_file_wake_no_reload(tmp_path):
    """A newcomer's ``serve --config ./config.yaml > sidecar.log``: the log's writes are not config changes."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(with_weights(0.6)))
    with live_sidecar(config_path=path, poll_interval=30.0) as (url, sidecar), SidecarClient(url) as c:
        time.sleep(0.3)  # the watch is set up
        reads = []
        poll = sidecar.poll_config_file
        sidecar.poll_config_file = lambda *a: reads.append(1) or poll(*a)
        with open(tmp_path / "sidecar.log", "a") as log:
            for i in range(20):
                log.write(f"line {i}\n")
                log.flush()
                time.sleep(0.05)
        time.sleep(0.6)  # longer than the watcher's debounce
        assert reads == []
        path.write_text(yaml.safe_dump(with_weights(0.9)))  # the config itself still reloads at once
        assert wait_for(lambda: c.config()["config"]["eviction"]["weights"]["reuse"] == 0.9, timeout=1.0) < 1.0
        assert reads
