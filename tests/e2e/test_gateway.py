"""The example gateway (manifests/gateway/) run by a real nginx with its njs module, in front of a stand-in
engine on 127.0.0.1 that records what it receives: what a deployment with ``trust_request_params: true``
relies on. The caller's tenant and class come from its API key, never from the body; bad callers and bad
bodies never reach the engine; streamed tokens are not held back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from support import free_port

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "manifests" / "gateway"
JS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")  # Debian's libnginx-mod-http-js
KEYS = {"sk-acme-chat": "acme toC", "sk-acme-batch": "acme toB"}

pytestmark = pytest.mark.skipif(
    shutil.which("nginx") is None or not JS_MODULE.exists(),
    reason="nginx with its njs module not installed (make test installs them)",
)


class Engine(BaseHTTPRequestHandler):
    """Records each request; a body with "stream": true is answered in two chunks, the second only once
    the test says the client has the first (or after 5 s)."""

    received: list[dict] = []
    first_chunk_seen = threading.Event()
    client_had_first_chunk: bool | None = None  # before the engine sent its second (None: no stream yet)

    def do_GET(self) -> None:
        self._record(b"")
        self._reply(b'{"data": []}')

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._record(body)
        if json.loads(body).get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(b"data: first\n\n")
            Engine.client_had_first_chunk = Engine.first_chunk_seen.wait(5)
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        else:
            self._reply(b'{"ok": true}')

    def _record(self, body: bytes) -> None:
        Engine.received.append({"path": self.path, "headers": dict(self.headers), "body": body})

    def _reply(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def rendered(text: str, replacements: dict[str, str]) -> str:
    """The shipped file with its deployment's names replaced by the test's (each must be there)."""
    for old, new in replacements.items():
        assert old in text, f"the shipped gateway no longer names {old!r}: update this test with it"
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("gateway")
    engine = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    port = free_port()
    (tmp / "keys.map").write_text("".join(f'"Bearer {k}" "{v}";\n' for k, v in KEYS.items()))
    shutil.copy(GATEWAY / "kvpool_gateway.js", tmp)
    (tmp / "kvpool-gateway.conf").write_text(rendered((GATEWAY / "kvpool-gateway.conf").read_text(), {
        "/etc/nginx/kvpool/": f"{tmp}/",
        "/etc/kvpool-gateway/keys.map": str(tmp / "keys.map"),
        "listen 8080;": f"listen 127.0.0.1:{port};",
        "http://qwen-chat:8000": f"http://127.0.0.1:{engine.server_port}",
    }))
    main = rendered((GATEWAY / "nginx.conf").read_text(), {
        "/tmp/": f"{tmp}/",  # first: the test's folder is below /tmp too
        "modules/ngx_http_js_module.so": str(JS_MODULE),
        "/etc/nginx/kvpool/": f"{tmp}/",
    })
    if os.getuid() == 0:  # workers would run as nobody, who cannot enter pytest's 0700 folders
        main = "user root;\n" + main
    (tmp / "nginx.conf").write_text(main)
    proc = subprocess.Popen(["nginx", "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(tmp / "nginx.conf"),
                             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            httpx.get(url + "/nothing", timeout=1)
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"nginx did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.05)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        engine.shutdown()


def post(url: str, body: object, key: str | None = "sk-acme-chat", raw: bytes | None = None) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(url + "/v1/completions", content=content, headers=headers, timeout=10)


def test_the_callers_key_sets_its_tenant_and_class_whatever_the_body_claims(gateway):
    Engine.received.clear()
    claim = {"model": "qwen", "prompt": "hello", "max_tokens": 4, "stop": [], "temperature": 0.123456789,
             "logit_bias": {}, "user": "ü", "kv_transfer_params": {"tenant": "globex", "workload_class": "toB"},
             "cache_salt": "globex"}
    assert post(gateway, claim).json() == {"ok": True}
    assert post(gateway, {"model": "qwen", "prompt": "x"}, key="sk-acme-batch").status_code == 200
    nested: object = 1
    for _ in range(20):
        nested = {"a": nested}
    assert post(gateway, {"prompt": "x", "response_format": nested}).status_code == 200  # deep enough for JSON schemas
    chat, batch, _ = (json.loads(r["body"]) for r in Engine.received)
    assert chat["kv_transfer_params"] == {"tenant": "acme", "workload_class": "toC"}
    assert chat["cache_salt"] == "acme"
    assert {k: v for k, v in chat.items() if k not in ("kv_transfer_params", "cache_salt")} == {
        k: v for k, v in claim.items() if k not in ("kv_transfer_params", "cache_salt")}  # the rest as sent
    assert batch["kv_transfer_params"] == {"tenant": "acme", "workload_class": "toB"}
    assert all("authorization" not in {h.lower() for h in r["headers"]} for r in Engine.received)
    assert httpx.get(gateway + "/v1/models", headers={"Authorization": "Bearer sk-acme-chat"}).status_code == 200


def test_a_callers_kv_cache_source_header_never_reaches_the_engine(gateway):
    """llm-d's routing proxy in front of vLLM replaces the body's kv_transfer_params (the tenant and class set
    here) with a peer hint when a request carries its router's source header (docs/routing.md): the gateway
    drops a caller's."""
    Engine.received.clear()
    headers = {"Authorization": "Bearer sk-acme-chat", "X-KV-Cache-Source-Host-Port": "10.0.0.7:8000"}
    response = httpx.post(gateway + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=10)
    assert response.status_code == 200
    [request] = Engine.received
    assert "x-kv-cache-source-host-port" not in {h.lower() for h in request["headers"]}
    assert json.loads(request["body"])["kv_transfer_params"] == {"tenant": "acme", "workload_class": "toC"}


def test_unknown_callers_and_bad_bodies_never_reach_the_engine(gateway):
    Engine.received.clear()
    deep: object = 1
    for _ in range(500):  # vLLM 0.32 dies on this one (docs/security.md)
        deep = {"a": deep}
    cases = [
        (post(gateway, {"prompt": "x"}, key=None), 401, "Authorization"),
        (post(gateway, {"prompt": "x"}, key="sk-guessed"), 401, "Authorization"),
        (post(gateway, None, raw=b"not json"), 400, "body"),
        (post(gateway, [1, 2]), 400, "body"),
        (post(gateway, {"prompt": "x", "kv_transfer_params": deep}), 400, "body"),
    ]
    for response, status, field in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["field"] == field
    assert "32 levels" in cases[-1][0].json()["error"]["rule"]
    assert httpx.get(gateway + "/v1/models").status_code == 401
    assert Engine.received == []


def test_streamed_tokens_pass_as_the_engine_makes_them(gateway):
    Engine.first_chunk_seen.clear()
    Engine.client_had_first_chunk = None
    headers = {"Authorization": "Bearer sk-acme-chat"}
    with httpx.stream("POST", gateway + "/v1/completions", json={"prompt": "x", "stream": True}, headers=headers,
                      timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines) == "data: first"
        Engine.first_chunk_seen.set()  # the engine sends the rest now (a gateway that buffered would wait 5 s)
        rest = [line for line in lines if line]
    assert Engine.client_had_first_chunk is True
    assert rest == ["data: [DONE]"]
