"""The sidecar API over real HTTP against a live server on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from kvpool_sidecar.client import SidecarClient, SidecarError
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.service.server import ServeError, ServeOptions, build
from support import live_sidecar

PROMPT = list(range(1, 18))  # 17 tokens: 4 full pages of 4 and a partial one


def test_admit_commit_release_and_prefix_reuse(sidecar_url):
    url, sidecar = sidecar_url
    with SidecarClient(url) as c:
        first = c.admit("a", PROMPT, meta={"user": "alice"})
        assert first.num_cached_tokens == 0 and len(first.page_ids) == 5
        assert c.commit("a", 17) == 4
        c.release("a")
        second = c.admit("b", PROMPT[:16] + [99], meta={"user": "bob"})
        assert second.num_cached_tokens == 16 and second.page_ids[:4] == first.page_ids[:4]
        assert c.lookup(PROMPT) == 16
        c.release("b")
        stats = c.stats()
        assert stats["cached_pages"] == 4 and stats["in_use_pages"] == 0 and stats["sequences"] == 0
        assert stats["backend"]["storage"] == "none"
        metrics = c.metrics()
    assert 'kvpool_hit_tokens_total{region="prefix",workload_class="toC"} 5.0' in metrics
    assert 'kvpool_cross_user_hit_tokens_total{workload_class="toC"} 16.0' in metrics
    sidecar.pool.check_invariants()


def test_fork_append_and_block_hashes(sidecar_url):
    url, _ = sidecar_url
    with SidecarClient(url) as c:
        c.admit("a", block_hashes=[11, 12, "x13"], num_tokens=10)
        c.commit("a", 10)
        forked = c.fork("a", "a2")
        assert forked.copy_src != -1 and forked.copy_dst not in (forked.page_ids[:2])
        assert len(c.append("a2", 3)) == 1
        c.release("a")
        c.release("a2")
        assert c.lookup(block_hashes=[11, 12]) == 8


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "error", "field"),
    [
        ("POST", "/v1/sequences", {"seq_id": "a", "tokens": [1]}, 409, "duplicate_sequence", "seq_id"),
        ("POST", "/v1/sequences", {"seq_id": "n", "tokens": [1], "block_hashes": [1]}, 422, "invalid_request", ""),
        ("POST", "/v1/sequences", {"seq_id": "n", "tokens": [-1]}, 422, "invalid_request", "tokens.0"),
        ("POST", "/v1/sequences", {"seq_id": "n", "tokens": []}, 422, "invalid_request", "tokens"),
        ("POST", "/v1/sequences", {"seq_id": "bad id!", "tokens": [1]}, 422, "invalid_request", "seq_id"),
        ("POST", "/v1/sequences", {"seq_id": "n", "tokens": [1], "meta": {"workload_class": "x"}}, 422,
         "invalid_request", "meta.workload_class"),
        ("POST", "/v1/sequences", {"seq_id": "n", "tokens": [1], "extra": 1}, 422, "invalid_request", "extra"),
        ("POST", "/v1/sequences", {"seq_id": "n", "tokens": list(range(2000))}, 503, "pool_exhausted", ""),
        ("POST", "/v1/sequences", {"seq_id": "n", "block_hashes": [1, 2], "num_tokens": 99}, 422,
         "invalid_request", "num_tokens"),
        ("POST", "/v1/sequences/zz/commit", {"num_computed_tokens": 1}, 404, "unknown_sequence", "seq_id"),
        ("POST", "/v1/sequences/a/commit", {"num_computed_tokens": 99}, 422, "invalid_request",
         "num_computed_tokens"),
        ("POST", "/v1/sequences/a/append", {"num_new_tokens": -1}, 422, "invalid_request", "num_new_tokens"),
        ("POST", "/v1/sequences/a/fork", {"new_seq_id": "a"}, 409, "duplicate_sequence", "new_seq_id"),
        ("DELETE", "/v1/sequences/zz", None, 404, "unknown_sequence", "seq_id"),
        ("POST", "/v1/pins", {"seq_id": "a", "tokens": [1]}, 422, "invalid_request", ""),
        ("POST", "/v1/pins", {"tokens": [7, 7, 7, 7]}, 422, "invalid_request", "tokens"),
        ("POST", "/v1/pins", {"seq_id": "a", "ttl_seconds": 0}, 422, "invalid_request", "ttl_seconds"),
        ("DELETE", "/v1/pins/pin-999", None, 404, "unknown_pin", "pin_id"),
        ("GET", "/v1/nothing", None, 404, "http_error", ""),
    ],
)
def test_error_paths_answer_json_and_change_nothing(sidecar_url, method, path, body, status, error, field):
    url, sidecar = sidecar_url
    with SidecarClient(url) as c:
        c.admit("a", PROMPT)
        c.commit("a", 8)
        before = (c.stats(), sidecar.pool.pins)
        response = httpx.request(method, url + path, json=body)
        assert response.status_code == status, response.text
        assert response.json() == {"error": error, "detail": response.json()["detail"], "field": field}
        assert response.json()["detail"]
        after = (c.stats(), sidecar.pool.pins)
    assert after == before
    sidecar.pool.check_invariants()


def test_invalid_json_and_wrong_content_are_400(sidecar_url):
    url, _ = sidecar_url
    r = httpx.post(url + "/v1/sequences", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_json"
    r = httpx.post(url + "/v1/sequences", content=b"seq_id=a")
    assert r.status_code == 400 and "application/json" in r.json()["detail"]


def test_pins_and_quota_over_http():
    config = SidecarConfig.model_validate(
        {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"quotaPercent": 2, "autoPin": {"enabled": False}}}
    )
    with live_sidecar(config, pages=100) as (url, sidecar), SidecarClient(url) as c:  # quota: 2 pages
        c.admit("a", PROMPT)
        c.commit("a", 17)
        c.release("a")
        pin = c.pin(PROMPT[:8], ttl_seconds=60)
        assert len(pin["pages"]) == 2 and pin["expires_at"] is not None
        with pytest.raises(SidecarError) as err:
            c.pin(PROMPT)
        assert err.value.status == 409 and err.value.field == "pinning.quotaPercent"
        c.unpin(pin["pin_id"])
        assert c.stats()["pinned_pages"] == 0


def test_bearer_token_is_required_when_configured():
    token = "s3cret-token-0123456789"
    with live_sidecar(token=token) as (url, _):
        r = httpx.get(url + "/v1/stats")
        assert r.status_code == 401 and r.json()["field"] == "authorization"
        assert httpx.get(url + "/v1/stats", headers={"authorization": "Bearer wrong"}).status_code == 401
        with SidecarClient(url, token=token) as c:
            assert c.stats()["total_pages"] == 256
        assert httpx.get(url + "/healthz").status_code == 200  # probes stay open


def test_serve_refuses_a_config_whose_named_prompts_exceed_the_pin_quota_of_its_pool(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("pageSize: 4\npinning: {quotaPercent: 10, prompts: [{name: sys, model: m, tokens: "
                      f"{list(range(4 * 7))}}}]}}\n")
    with pytest.raises(ServeError, match=r"pinning.prompts: the named prompts fill 7 pages: more than the pin quota "
                                         r"of 6 pages \(pinning.quotaPercent 10 of 64\)"):
        build(ServeOptions(config=str(config), pages=64))
    sidecar, _ = build(ServeOptions(config=str(config), pages=70))
    assert sidecar.pool.pinning.quota == 7


def test_serve_refuses_to_expose_the_api_without_a_token(tmp_path):
    with pytest.raises(ServeError, match="--token-file"):
        build(ServeOptions(host="0.0.0.0"))
    short = tmp_path / "token"
    short.write_text("abc")
    with pytest.raises(ServeError, match="at least 16"):
        build(ServeOptions(host="0.0.0.0", token_file=str(short)))
    short.write_text("a-long-enough-token-value")
    sidecar, credentials = build(ServeOptions(host="0.0.0.0", token_file=str(short), pages=64))
    assert credentials is not None and sidecar.pool.total_pages == 64
    assert str(credentials.who("a-long-enough-token-value")) == "admin"  # one bare token: the admin
    sidecar.close()
    # The retired router's role is refused naming the line, not taken as some other role.
    short.write_text("admin a-long-enough-token-value\nrouter r-long-enough-token-value\n")
    with pytest.raises(ServeError, match="line 2: role 'router' is not admin, engine or tenant:NAME"):
        build(ServeOptions(host="0.0.0.0", token_file=str(short)))
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool_sidecar.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "--token-file" in proc.stderr


def test_concurrent_clients_keep_the_pool_consistent(sidecar_url):
    url, sidecar = sidecar_url
    errors: list[Exception] = []

    def worker(w: int) -> None:
        try:
            with SidecarClient(url) as c:
                for i in range(40):
                    seq = f"w{w}-{i}"
                    tokens = [w % 3] * 8 + [i % 5] * 8 + [w, i]
                    c.admit(seq, tokens)
                    c.commit(seq, len(tokens))
                    c.release(seq)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = SidecarClient(url).stats()
    assert stats["sequences"] == 0 and stats["free_pages"] + stats["cached_pages"] == stats["total_pages"]
    sidecar.pool.check_invariants()


def test_openapi_schema_lists_every_route(sidecar_url):
    url, _ = sidecar_url
    paths = httpx.get(url + "/openapi.json").json()["paths"]
    for path in ("/v1/sequences", "/v1/sequences/{seq_id}/commit", "/v1/sequences/{seq_id}/append",
                 "/v1/sequences/{seq_id}/fork", "/v1/sequences/{seq_id}", "/v1/lookup", "/v1/pins",
                 "/v1/pins/{pin_id}", "/v1/stats", "/v1/config", "/healthz", "/readyz"):
        assert path in paths


def test_a_terminated_sidecar_leaves_its_segment_to_its_restart_while_an_engine_maps_it(tmp_path):
    """SIGTERM (what Kubernetes sends, a failed liveness probe too) while an engine maps the pool: tmpfs
    frees its pages only when the last mapping goes, so the segment stays, stamped with a dead epoch (the
    mapping sees it gone); the restart takes that very file over: one segment of the instance in /dev/shm,
    never two. With no engine mapping it, a SIGTERM removes it."""
    import os
    import time
    from pathlib import Path

    from kvpool_sidecar.service.server import instance_name
    from kvpool_sidecar.storage import KVStorage, StaleHandle
    from kvpool_sidecar.storage.segment import release_instance
    from support import free_port

    port = free_port()
    prefix = f"kvpool-{instance_name(port)}-"

    def start() -> tuple[subprocess.Popen, dict]:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(port),
                                 "--pages", "8", "--kv-shape", "1,1,8,float32", "--log-level", "error"])
        deadline = time.monotonic() + 30
        while True:
            try:
                return proc, httpx.get(f"http://127.0.0.1:{port}/v1/storage/handle", timeout=0.5).json()
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)

    try:
        proc, handle = start()
        engine = KVStorage.attach(handle)
        proc.terminate()
        proc.wait(timeout=30)
        assert os.path.exists(f"/dev/shm/{handle['name']}")
        with pytest.raises(StaleHandle):
            engine.check()
        proc, again = start()
        assert again["name"] == handle["name"] and again["epoch"] != handle["epoch"]
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == [handle["name"]]
        engine.close()  # no engine maps the pool any more: a SIGTERM leaves nothing behind
        proc.terminate()
        proc.wait(timeout=30)
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    finally:
        release_instance(instance_name(port))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def test_an_oversized_body_is_refused_before_it_is_read_and_changes_nothing():
    from kvpool_sidecar.service.app import create_app
    from kvpool_sidecar.service.state import Sidecar
    from support import live_app

    config = SidecarConfig.model_validate({"pageSize": 4, "pinning": {"autoPin": {"enabled": False}}})
    sidecar = Sidecar(config, 64, max_sequences=3)
    with live_app(create_app(sidecar, max_body_bytes=4096, pre_evict_interval=0)) as url, SidecarClient(url) as c:
        big = {"seq_id": "big", "tokens": list(range(2000))}  # about 10 KB of JSON
        answer = httpx.post(url + "/v1/sequences", json=big)
        assert answer.status_code == 413 and answer.json()["error"] == "too_large"
        assert "4096 bytes" in answer.json()["detail"]

        def chunks():
            yield b'{"seq_id": "big", "tokens": ['
            for _ in range(2000):
                yield b"1, "
            yield b"1]}"

        chunked = httpx.post(url + "/v1/sequences", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413  # no Content-Length: counted as it arrives
        for i in range(3):
            c.admit(f"s{i}", [i] * 4)
        with pytest.raises(SidecarError) as err:
            c.admit("s3", [9] * 4)
        assert (err.value.status, err.value.error) == (429, "too_many_sequences")
        assert "--max-sequences" in err.value.detail
        assert c.stats()["sequences"] == 3 and httpx.get(url + "/healthz").status_code == 200
    sidecar.pool.check_invariants()


TOKENS = """# role token
admin   admin-token-0123456789
engine  engine-token-0123456789
tenant:acme   acme-token-0123456789
tenant:globex globex-token-0123456789
"""


def test_a_tenant_credential_acts_only_for_its_tenant():
    """Issue 21's tenant spoofing: who the caller is comes from its token, not the body."""
    from kvpool_sidecar.service.credentials import Credentials

    prompt = list(range(1, 17))
    with live_sidecar(token=Credentials.parse(TOKENS)) as (url, sidecar):
        admin, engine, acme, globex = (SidecarClient(url, token=f"{name}-token-0123456789")
                                       for name in ("admin", "engine", "acme", "globex"))
        acme.admit("a1", prompt)  # names no tenant: taken as acme
        acme.commit("a1", 16)
        acme.release("a1")
        assert engine.lookup(prompt, meta={"tenant": "acme"}) == 16  # the engine acts for any tenant
        assert globex.lookup(prompt) == 0  # globex's own keys: acme's pages are not there
        for call in (lambda: globex.lookup(prompt, meta={"tenant": "acme"}),
                     lambda: globex.admit("g1", prompt, meta={"tenant": "acme"})):
            with pytest.raises(SidecarError) as err:
                call()
            assert (err.value.status, err.value.error, err.value.field) == (403, "forbidden", "meta.tenant")
        results = globex.batch([{"op": "admit", "seq_id": "g2", "block_hashes": [1, 2], "meta": {"tenant": "acme"}},
                                {"op": "admit", "seq_id": "g3", "block_hashes": [1, 2]}])
        assert results[0]["error"]["error"] == "forbidden" and results[1]["ok"]
        with pytest.raises(SidecarError) as err:
            acme.release("g3")  # another tenant's sequence is not there for acme
        assert err.value.status == 404
        globex.release("g3")
        pin = acme.pin(prompt)
        with pytest.raises(SidecarError) as err:
            globex.unpin(pin["pin_id"])
        assert err.value.status == 404
        for call, what in ((lambda: acme.put_config({"tenancy": {"isolation": "none"}}), "changing the config"),
                           (lambda: acme.storage_handle(), "mapping the pool"),
                           (lambda: engine.put_config({"tenancy": {"isolation": "none"}}), "changing the config")):
            with pytest.raises(SidecarError) as err:
                call()
            assert err.value.status == 403 and what in err.value.detail
        assert sidecar.state.config.tenancy.isolation == "perTenant"
        acme.unpin(pin["pin_id"])
        admin.put_config({"pageSize": 4, "pinning": {"autoPin": {"enabled": False}}})  # the admin may
        with pytest.raises(SidecarError) as err:
            SidecarClient(url, token="not-a-token-0123456789").stats()
        assert err.value.status == 401
        for c in (admin, engine, acme, globex):
            c.close()
    sidecar.pool.check_invariants()


def test_owners_of_lapsed_pins_are_forgotten():
    from kvpool_sidecar.pool import WorkloadMeta
    from kvpool_sidecar.service.state import Sidecar

    now = [0.0]
    config = SidecarConfig.model_validate({"pageSize": 4, "pinning": {"quotaPercent": 50,
                                                                      "autoPin": {"enabled": False}}})
    sidecar = Sidecar(config, 64, clock=lambda: now[0])
    sidecar.pool.admit("s", [1, 2, 3, 4])
    sidecar.pool.commit("s", 4)
    sidecar.pool.release("s")
    for _ in range(5000):
        sidecar.pin([1, 2, 3, 4], meta=WorkloadMeta(), ttl=1.0)
        now[0] += 2.0  # each pin has lapsed before the next
    assert len(sidecar._pin_owner) <= 1026  # bounded, not one per pin ever made
    sidecar.close()


def test_limits_on_tokens_and_pins_answer_413_and_429_naming_the_limit():
    """Issue 21's unbounded resources: a 5M-token pin, thousands of pin records on the same pages."""
    with live_sidecar(pages=64, max_sequence_tokens=64, max_pins_per_owner=3,
                      config=SidecarConfig.model_validate({"pageSize": 4, "pinning": {
                          "quotaPercent": 50, "autoPin": {"enabled": False}}})) as (url, sidecar), \
            SidecarClient(url) as c:
        c.admit("a", PROMPT)
        c.commit("a", 17)
        before = c.stats()
        for call, field in ((lambda: c.admit("b", list(range(65))), "tokens"),
                            (lambda: c.pin(list(range(65))), "tokens"),
                            (lambda: c.lookup(list(range(65))), "tokens"),
                            (lambda: c.admit("b", block_hashes=list(range(17))), "block_hashes"),
                            (lambda: c.append("a", 48), "num_new_tokens")):
            with pytest.raises(SidecarError) as err:
                call()
            assert (err.value.status, err.value.error, err.value.field) == (413, "too_long", field)
            assert "--max-sequence-tokens" in err.value.detail
        assert c.stats() == before  # nothing admitted, grown or pinned
        c.append("a", 47)  # 64 tokens: at the limit is allowed
        c.release("a")
        pins = [c.pin(PROMPT[:8]) for _ in range(3)]  # the same pages: no new quota used, but records
        with pytest.raises(SidecarError) as err:
            c.pin(PROMPT[:8])
        assert (err.value.status, err.value.error) == (429, "too_many_pins")
        assert "--max-pins-per-owner" in err.value.detail and c.stats()["pins"] == 3
        c.unpin(pins[0]["pin_id"])
        c.pin(PROMPT[:8])  # room again once one is gone
    sidecar.pool.check_invariants()


def test_lowering_the_pin_quota_unpins_the_oldest_and_says_so():
    config = {"pageSize": 4, "eviction": {"policy": "lru"}, "pinning": {"quotaPercent": 20,
                                                                        "autoPin": {"enabled": False}}}
    with live_sidecar(SidecarConfig.model_validate(config), pages=40) as (url, sidecar), SidecarClient(url) as c:
        prompts = [[100 * i + t for t in range(1, 9)] for i in range(1, 5)]  # 2 pages each: 8 pinned of 8
        pins = []
        for i, prompt in enumerate(prompts):
            c.admit(f"s{i}", prompt)
            c.commit(f"s{i}", 8)
            c.release(f"s{i}")
            pins.append(c.pin(prompt)["pin_id"])
        assert c.stats()["pinned_pages"] == 8
        view = c.put_config({**config, "pinning": {"quotaPercent": 10, "autoPin": {"enabled": False}}})
        assert c.stats()["pinned_pages"] == 4 and c.stats()["pin_quota_pages"] == 4
        assert set(sidecar.pool.pinning.records) == set(pins[2:])  # the two oldest went
        assert "unpinned the 2 oldest pins" in view["notice"] and pins[0] in view["notice"]
        scrape = httpx.get(url + "/metrics").text
        assert 'kvpool_pins_removed_total{reason="quota_lowered"} 2.0' in scrape
        assert c.lookup(prompts[0]) == 8  # unpinned, not evicted: still cached
        with pytest.raises(SidecarError):
            c.unpin(pins[0])  # gone
        view = c.put_config({**config, "pinning": {"quotaPercent": 30, "autoPin": {"enabled": False}}})
        assert view["notice"] is None
    sidecar.pool.check_invariants()


def test_a_put_with_the_removed_selector_is_refused_saying_why():
    with live_sidecar() as (url, sidecar), SidecarClient(url) as c:
        before = sidecar.state.hash
        with pytest.raises(SidecarError) as err:
            c.put_config({"pageSize": 4, "selector": {"matchLabels": {"app": "chat"}}})
        assert err.value.status == 422 and err.value.field == "selector" and "kvpool.dev/policy" in str(err.value)
        assert sidecar.state.hash == before


def test_auto_pins_are_listed_for_the_admin_removable_and_counted():
    from kvpool_sidecar.config import SidecarConfig
    from kvpool_sidecar.service.credentials import Credentials

    config = SidecarConfig.model_validate({"pageSize": 4, "eviction": {"policy": "lru"},
                                           "pinning": {"quotaPercent": 10, "autoPin": {"minPromptTokens": 8}}})
    with live_sidecar(config, pages=80, token=Credentials.parse(TOKENS)) as (url, _):
        admin = SidecarClient(url, token="admin-token-0123456789")
        for i in range(6):  # 3-page prompts against an 8-page quota: the oldest auto-pins yield
            admin.admit(f"s{i}", [100 + i] * 12)
            admin.commit(f"s{i}", 12)
            admin.release(f"s{i}")
        listed = httpx.get(url + "/v1/pins", headers={"Authorization": "Bearer admin-token-0123456789"}).json()
        autos = [p for p in listed["pins"] if p["auto"]]
        assert len(autos) == 2 and all(p["pages"] == 3 for p in autos)
        assert httpx.get(url + "/v1/pins", headers={"Authorization": "Bearer acme-token-0123456789"}).json() == {
            "pins": []}  # a tenant sees only its own
        admin.unpin(autos[0]["pin_id"])  # an admin removes an auto-pin
        text = httpx.get(url + "/metrics").text
        assert 'kvpool_autopins_total{result="pinned"} 6.0' in text
        assert 'kvpool_autopins_total{result="displaced"} 4.0' in text
