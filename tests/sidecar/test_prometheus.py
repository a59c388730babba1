"""Real Prometheus scrapes a running sidecar; promtool accepts the exposition."""

from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import pytest
from kvpool_sidecar.client import SidecarClient
from support import free_port, live_sidecar

needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="prometheus/promtool not installed (make test installs the Debian package)",
)


def traffic(url: str) -> None:
    with SidecarClient(url) as c:
        for i in range(5):
            c.admit(f"s{i}", list(range(16)) + [i], meta={"user": f"u{i}"})
            c.commit(f"s{i}", 17)
            c.release(f"s{i}")


@needs_prometheus
def test_promtool_accepts_the_exposition():
    with live_sidecar() as (url, _):
        traffic(url)
        text = httpx.get(url + "/metrics").text
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_prometheus
def test_prometheus_scrapes_the_hit_counters(tmp_path):
    with live_sidecar() as (url, _):
        traffic(url)
        target = url.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: kvpool\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        port = free_port()
        prom = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            query = 'sum(kvpool_hit_tokens_total{workload_class="toC"})'
            deadline = time.monotonic() + 60
            value = None
            while time.monotonic() < deadline:
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=2)
                    result = r.json()["data"]["result"]
                    if result:
                        value = float(result[0]["value"][1])
                        break
                except (httpx.HTTPError, KeyError, ValueError):
                    pass
                time.sleep(0.5)
            assert value == 4 * 16, f"Prometheus answered {value!r}"
            up = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "up{job='kvpool'}"}).json()
            assert up["data"]["result"][0]["value"][1] == "1"
        finally:
            prom.terminate()
            prom.wait(timeout=30)


def test_scrapes_on_the_metrics_port_see_a_consistent_pool_while_clients_mutate_it():
    """--metrics-port is served by prometheus_client's own thread; heavy admissions run on the pool's
    worker thread: a scrape reads the pool under its mutex, so its page states always add up."""
    import threading
    import time

    import httpx
    from kvpool_sidecar.client import SidecarClient
    from kvpool_sidecar.config import SidecarConfig
    from prometheus_client import start_http_server
    from support import free_port, live_sidecar

    pages = 6000
    config = SidecarConfig.model_validate({"pageSize": 4, "eviction": {"policy": "lru"},
                                           "workloads": {"toB": {"isolationPercent": 0}},
                                           "pinning": {"autoPin": {"enabled": False}}})
    with live_sidecar(config, pages=pages) as (url, sidecar):
        port = free_port()
        server, _ = start_http_server(port, "127.0.0.1", registry=sidecar.metrics.registry)
        stop = threading.Event()
        errors: list[BaseException] = []

        def client(i: int) -> None:
            try:
                with SidecarClient(url) as c:
                    k = 0
                    while not stop.is_set():
                        n = 2100 * 4 if i < 2 and k % 3 == 0 else 40  # two clients send heavy admissions
                        seq = f"c{i}-{k}"
                        c.admit(seq, [i * 1_000_000 + k * 10_000 + j for j in range(n)])
                        c.commit(seq, n)
                        c.release(seq)
                        k += 1
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        scrapes = 0
        try:
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline:
                r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
                assert r.status_code == 200
                states = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
                          if line.startswith("kvpool_pages{")}
                assert states["free"] + states["in_use"] + states["cached"] == pages, states
                scrapes += 1
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            server.shutdown()
        assert scrapes > 10 and not errors
