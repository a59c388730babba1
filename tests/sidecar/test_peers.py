"""Peer fetches between real sidecars on 127.0.0.1 (issue 66): a source process (``serve --peer-port``) and a
reader (this process's sidecar) that reads the source's held pages with NIXL. Bytes equal the source's; a
missing key, another tenant or a peer outside the members gets nothing; a source killed -9 or stopped mid-fetch
costs a miss within the budget; nothing is published unwritten, and no page, hold or sequence stays behind on
either side."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from kvpool_sidecar import wire
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.engines.link import Connection
from kvpool_sidecar.keys import WorkloadMeta
from kvpool_sidecar.peers import agent as peer_agent
from kvpool_sidecar.peers import protocol
from kvpool_sidecar.peers.host import pool_keys
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.peers.node import Peers, parse_peers
from kvpool_sidecar.peers.runs import page_runs
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.storage import KVStorage, ModelShape
from support import CLUSTER_KEYS, free_port, socket_path

PS = 4
SHAPE = ModelShape(2, 2, 8, "float32")  # 512 bytes a page
MODEL = "m@peers"
CONFIG = {"pageSize": PS, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
needs_nixl = pytest.mark.skipif(not peer_agent.available(), reason="NIXL is not installed: the peers extra "
                                "(pip install 'kvpool[peers]'; `make venv` installs it)")


def hashes(n: int, tag: str = "p") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


class Source:
    """A real sidecar process serving its pool to peers on 127.0.0.1."""

    def __init__(self, folder: Path, keys: TransferKeys = CLUSTER_KEYS, pinning: str = "autoPin: {enabled: false}",
                 extra: tuple[str, ...] = ()) -> None:
        config = folder / "config.yaml"
        config.write_text(f"pageSize: {PS}\neviction: {{policy: lru}}\npinning: {{{pinning}}}\n")
        keyfile = folder / "keys"
        keyfile.write_text("".join(f"{kid} {secret.decode()}\n" for kid, secret in keys.keys))
        self.port, self.peer_port, self.socket = free_port(), free_port(), socket_path()
        shape = f"{SHAPE.layers},{SHAPE.kv_heads},{SHAPE.head_dim},{SHAPE.dtype}"
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", "--port", str(self.port), "--pages",
             "32", "--kv-shape", shape, "--config", str(config), "--engine-socket", self.socket,
             "--engine-quarantine-seconds", "0.1", "--transfer-key-file", str(keyfile), "--peer-port",
             str(self.peer_port), "--peer-host", "127.0.0.1", "--log-level", "warning", *extra],
            stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        while not self.healthy():
            assert self.proc.poll() is None, self.proc.stderr.read()
            assert time.monotonic() < deadline, "the source sidecar did not start"
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=0.5).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.peer_port)

    def fill(self, blocks: list[bytes], tenant: str = "default", hashing: wire.Hashing | None = None) -> torch.Tensor:
        """The blocks saved and committed as an engine would (random KV); returns their pages' bytes."""
        conn = Connection(self.socket, wire.Hello(wire.PROTOCOL, "scheduler", "filler", MODEL, hashing=hashing), 2.0)
        attached = KVStorage.attach(conn.welcome.storage)
        try:
            meta = wire.Meta(tenant=tenant)
            reply = conn.step(wire.Step(admits=[wire.Admit("fill", blocks, len(blocks) * PS, meta)]))
            admitted = reply.admits[0]
            assert isinstance(admitted, wire.Admitted), admitted
            kv = torch.randn((len(blocks), *attached.kv.shape[1:]))
            with attached.writing(admitted.fence):
                attached.kv[admitted.page_ids] = kv
            conn.step(wire.Step(commits=[wire.Commit("fill", len(blocks) * PS)], releases=["fill"]))
            return kv
        finally:
            attached.close()
            conn.close()

    def stats(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.port}/v1/stats", timeout=5).json()

    def idle(self) -> None:
        """Every hold this source made for a peer released: no sequence, no page in use."""
        deadline = time.monotonic() + 5
        while (st := self.stats())["sequences"] or st["in_use_pages"]:
            assert time.monotonic() < deadline, f"the source still holds pages for a peer: {st}"
            time.sleep(0.02)

    def metric(self, name: str) -> float:
        body = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """One source process for the module, started again only after a test killed it."""
    live: list[Source] = []
    yield lambda: live[-1] if live and live[-1].proc.poll() is None else live.append(
        Source(tmp_path_factory.mktemp("source"))) or live[-1]
    for src in live:
        src.stop()


@pytest.fixture
def source(sources):
    if not peer_agent.available():
        pytest.skip("NIXL is not installed: the peers extra (pip install 'kvpool[peers]'; `make venv` installs it)")
    return sources()


class Reader:
    """This process's sidecar (shared pool, NIXL agent) fetching from the members it is given."""

    def __init__(self, *members: tuple[str, int], keys: TransferKeys = CLUSTER_KEYS, pages: int = 32) -> None:
        self.storage = KVStorage(SHAPE, PS, pages=pages, shared=True)
        self.sidecar = Sidecar(SidecarConfig.model_validate(CONFIG), pages, storage=self.storage, transfer_keys=keys)
        self.peers = Peers(self.sidecar, keys, members=frozenset(members))

    def fetch(self, peer: tuple[str, int], blocks: list[bytes], tenant: str = "default", budget: float = 2.0):
        async def go():
            return await self.peers.client.fetch(peer, MODEL, blocks, WorkloadMeta(tenant=tenant), budget)

        return self.loop.run_until_complete(go())

    def cached_kv(self, blocks: list[bytes], tenant: str = "default") -> torch.Tensor:
        """The KV of the blocks' pages as this pool caches them (all of them must be)."""
        from kvpool_sidecar.peers.host import pool_keys

        _, pages = self.sidecar.pool.cached_prefix(block_hashes=pool_keys(MODEL, blocks),
                                                   meta=WorkloadMeta(tenant=tenant))
        assert len(pages) == len(blocks)
        return self.storage.kv[pages].clone()

    def assert_clean(self) -> None:
        pool = self.sidecar.pool
        pool.check_invariants()  # I9 among them: no sequence alive, free + cached == total
        assert not pool.sequences.live
        assert not self.peers.client._parked

    def __enter__(self) -> Reader:
        self.loop = asyncio.new_event_loop()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.peers.client.close())
        self.loop.close()
        self.peers.agent.close()
        self.sidecar.close()
        self.storage.close()


def test_pages_batch_into_one_descriptor_per_run_contiguous_on_both_sides():
    assert page_runs([4, 5, 6, 9], [10, 11, 20, 21], 100, 1000, 50_000) == [
        (1400, 51000, 200), (1600, 52000, 100), (1900, 52100, 100)]
    with pytest.raises(ValueError, match="2 local pages for 1 remote"):
        page_runs([1, 2], [1], 100, 0, 0)


def test_a_hint_is_vllms_remote_kv_source_and_a_malformed_one_is_no_hint():
    from kvpool_sidecar.engines.hints import peer_source

    def hint(**kw):
        return {"remote_kv_source": kw}

    assert peer_source(hint(remote_host="10.0.0.7", remote_port=8300, kv_request_id="x")) == wire.Source(
        "10.0.0.7", 8300)
    assert peer_source(hint(remote_host="[::1]", remote_port="8300")) == wire.Source("::1", 8300)
    for bad in (None, {}, {"remote_kv_source": "h:1"}, hint(remote_host="h"), hint(remote_host="h", remote_port=0),
                hint(remote_host="", remote_port=1), hint(remote_host="h", remote_port=True),
                hint(remote_host="h" * 254, remote_port=1), hint(remote_host="h", remote_port=70000),
                # digits int() refuses (a client's body must never raise in the engine's scheduler)
                hint(remote_host="h", remote_port="\u00b2"), hint(remote_host="h", remote_port="9" * 5000)):
        assert peer_source(bad) is None, bad


def test_peers_flag_is_host_port_items_and_a_bad_one_is_named():
    assert parse_peers("a:1, [::1]:8100,") == {("a", 1), ("::1", 8100)}
    with pytest.raises(ValueError, match="'b:x' is not HOST:PORT"):
        parse_peers("a:1,b:x")


@needs_nixl
def test_a_fetch_writes_the_sources_bytes_and_publishes_them_then_releases_the_hold(source):
    blocks = hashes(6, "ok")
    kv = source.fill(blocks)
    with Reader(source.address) as reader:
        result = reader.fetch(source.address, blocks + hashes(2, "unknown"))
        assert (result.result, result.pages, result.cached_pages) == ("partial", 6, 6)
        assert result.nbytes == 6 * SHAPE.bytes_per_page(PS)
        assert torch.equal(reader.cached_kv(blocks), kv)
        registry = reader.sidecar.metrics.registry
        assert registry.get_sample_value("kvpool_peer_fetches_total", {"result": "partial"}) == 1
        assert registry.get_sample_value("kvpool_peer_fetch_pages_total") == 6
        source.idle()
        # Only past what is cached here: a longer prompt fetches its two new pages, the first six stay.
        more = hashes(2, "ok-more")
        tail = source.fill(blocks + more)[6:]
        again = reader.fetch(source.address, blocks + more)
        assert (again.result, again.pages, again.cached_pages) == ("hit", 2, 8)
        assert torch.equal(reader.cached_kv(blocks + more)[6:], tail)
        assert reader.fetch(source.address, blocks).result == "hit"  # all here: the peer is not asked
        reader.assert_clean()
        source.idle()
        assert source.metric("kvpool_peer_served_pages_total") >= 8


@pytest.mark.parametrize(("text", "message"), [
    ("", "no key"),
    ("k1 short", "at least 32 bytes"),
    ("k1 " + "s" * 40 + "\nk1 " + "t" * 40, "appears twice"),
    ("k1", "expected 'KEY_ID SECRET'"),
])
def test_a_bad_key_file_is_refused_naming_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        TransferKeys.parse(text)


@needs_nixl
def test_another_tenant_an_unknown_prompt_or_a_non_member_gets_nothing(source):
    blocks = hashes(4, "tenant-a")
    source.fill(blocks, tenant="a")
    with Reader(source.address) as reader:
        assert reader.fetch(source.address, blocks, tenant="b").result == "miss"
        assert reader.fetch(source.address, blocks).result == "miss"  # the default tenant is another one
        assert reader.fetch(source.address, hashes(3, "never")).result == "miss"
        assert reader.fetch(("127.0.0.1", 1), blocks, tenant="a").result == "not_member"
        assert reader.sidecar.pool.stats().cached_pages == 0
        assert reader.fetch(source.address, blocks, tenant="a").result == "hit"  # its own tenant's pages
        reader.assert_clean()
    source.idle()


@needs_nixl
def test_a_peer_without_the_cluster_key_is_refused_before_any_metadata_and_counted(source):
    import socket

    refused = source.metric('kvpool_peer_refused_total{reason="unauthorized"}')
    wrong = TransferKeys.parse("k1 " + "w" * 40)
    with Reader(source.address, keys=wrong) as reader:
        assert reader.fetch(source.address, hashes(2, "ok")).result == "refused"
        reader.assert_clean()
    assert source.metric('kvpool_peer_refused_total{reason="unauthorized"}') == refused + 1
    # A peer that says anything but a proof gets the challenge, then a refusal: never the agent's metadata.
    with socket.create_connection(source.address, timeout=5) as raw:
        raw.sendall(protocol.frame(protocol.Done()))
        got = b""
        while chunk := raw.recv(65536):
            got += chunk
    challenge_len = int.from_bytes(got[:4], "big")
    assert isinstance(protocol.decode(got[4:4 + challenge_len]), protocol.Challenge)
    assert isinstance(protocol.decode(got[8 + challenge_len:]), protocol.Refused)


@needs_nixl
def test_a_stopped_source_costs_a_timeout_within_the_budget_and_releases_its_hold_when_it_runs_again(source):
    blocks = hashes(3, "stopped")
    source.fill(blocks)
    with Reader(source.address) as reader:
        assert reader.fetch(source.address, hashes(1, "warm")).result == "miss"  # connected
        os.kill(source.proc.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            result = reader.fetch(source.address, blocks, budget=0.3)
            assert result.result == "timeout"
            assert time.monotonic() - start < 0.6
        finally:
            os.kill(source.proc.pid, signal.SIGCONT)
        reader.assert_clean()
        assert reader.sidecar.pool.stats().cached_pages == 0
        source.idle()  # it offered to a connection that was gone: the hold went with it
        assert reader.fetch(source.address, blocks).result == "hit"  # a new connection
        reader.assert_clean()


@needs_nixl
def test_a_source_stopped_mid_read_still_holds_its_pages_so_what_is_published_is_its_bytes(source):
    blocks = hashes(3, "stopped-mid")
    kv = source.fill(blocks)
    with Reader(source.address) as reader:
        read = reader.peers.agent.read

        def stop_then_read(*args):
            os.kill(source.proc.pid, signal.SIGSTOP)
            return read(*args)

        reader.peers.agent.read = stop_then_read
        try:
            result = reader.fetch(source.address, blocks, budget=0.4)
        finally:
            os.kill(source.proc.pid, signal.SIGCONT)
        if result.result == "hit":  # a single-copy read needs nothing of the stopped process
            assert torch.equal(reader.cached_kv(blocks), kv)
        else:  # a transport that needs the source's help times out: nothing published
            assert result.result == "timeout" and reader.sidecar.pool.stats().cached_pages == 0
        reader.assert_clean()
    source.idle()


@needs_nixl
def test_a_new_sidecar_holds_the_policys_named_prompt_with_its_peers_bytes_before_any_engine_connects(source):
    """Sidecar A (a process) holds a named prompt its engine computed; sidecar B (this process, its engine not
    started) fetches it at start, /readyz waiting for that, and pins it: A's bytes, before any engine asks."""
    from kvpool_sidecar.keys import engine_block_hashes
    from kvpool_sidecar.service.app import create_app
    from support import live_app

    seed = "PYTHONHASHSEED-of-the-policy"
    tokens, missing = list(range(1000, 1000 + 4 * PS + 2)), list(range(5000, 5000 + 4 * PS))
    blocks = engine_block_hashes(tokens, PS, "sha256", seed)
    probe = engine_block_hashes(list(range(PS)), PS, "sha256", seed)[0]
    kv = source.fill(blocks, hashing=wire.Hashing("sha256", seed, probe))  # A's engine computed the prompt
    config = SidecarConfig.model_validate(CONFIG | {"pinning": {"autoPin": {"enabled": False}, "prompts": [
        {"name": "doc", "model": "m", "tokens": tokens},
        {"name": "nobody-has-it", "model": "m", "tokens": missing}]}})
    storage = KVStorage(SHAPE, PS, pages=32, shared=True)
    sidecar = Sidecar(config, 32, storage=storage, transfer_keys=CLUSTER_KEYS)
    peers = Peers(sidecar, CLUSTER_KEYS, members=frozenset({source.address}))
    try:
        with live_app(create_app(sidecar, pre_evict_interval=0, peers=peers, peer_warmup=10)) as url:
            deadline = time.monotonic() + 10
            while (ready := httpx.get(url + "/readyz", timeout=2)).status_code != 200:
                assert (ready.status_code, ready.json()["error"]) == (503, "warming_up")
                assert time.monotonic() < deadline, "the new sidecar never became ready"
                time.sleep(0.02)
            registry = sidecar.metrics.registry
            assert registry.get_sample_value("kvpool_engine_sessions") == 0  # no engine has connected
            assert registry.get_sample_value("kvpool_peer_warmups_total", {"result": "fetched"}) == 1
            assert registry.get_sample_value("kvpool_peer_warmups_total", {"result": "none"}) == 1  # the engine's
            views = {v["name"]: v for v in httpx.get(url + "/v1/config", timeout=5).json()["prompts"]}
            assert (views["doc"]["pinned"], views["nobody-has-it"]["pinned"]) == (4, 0)  # held, pinned
            _, pages = sidecar.pool.cached_prefix(block_hashes=pool_keys(MODEL, blocks), meta=WorkloadMeta())
            assert torch.equal(storage.kv[pages], kv)  # A's bytes
    finally:  # the app's end closed the peers' client and agent
        sidecar.close()
        storage.close()
    source.idle()


def test_nixl_missing_is_named_with_the_extra_that_brings_it(monkeypatch):
    monkeypatch.setattr(peer_agent, "nixl_api", lambda: None)
    with pytest.raises(peer_agent.NixlMissing, match=r"kvpool\[peers\]"):
        peer_agent.PeerAgent(0, 0)


def test_serving_peers_needs_the_cluster_key_and_the_pools_kv():
    from kvpool_sidecar.service.server import ServeError, ServeOptions, build_peers

    sidecar = Sidecar(SidecarConfig.model_validate(CONFIG), 8)
    with pytest.raises(ServeError, match="--peer-port: .*--transfer-key-file"):
        build_peers(ServeOptions(peer_port=9000), sidecar)
    sidecar.transfer_keys = CLUSTER_KEYS
    with pytest.raises(ServeError, match="--peers: .*--kv-shape"):
        build_peers(ServeOptions(peers="a:1"), sidecar)
    assert build_peers(ServeOptions(), sidecar) is None
    sidecar.close()


@needs_nixl
def test_polled_members_replace_the_last_ones_and_a_failed_poll_keeps_them_counted():
    polls = [frozenset({("10.0.0.2", 8200), ("10.0.0.3", 8200)}), RuntimeError("API unreachable"),
             frozenset({("10.0.0.3", 8200)})]

    def poll() -> frozenset:
        answer = polls.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    with Reader() as reader:
        peers = Peers(reader.sidecar, CLUSTER_KEYS, membership=poll)
        registry = reader.sidecar.metrics.registry
        try:
            for members, errors in ((2, 0), (2, 1), (1, 1)):
                reader.loop.run_until_complete(peers.refresh_members())
                assert registry.get_sample_value("kvpool_peer_members") == members
                assert registry.get_sample_value("kvpool_peer_membership_errors_total") == errors
            gone = reader.loop.run_until_complete(
                peers.client.fetch(("10.0.0.2", 8200), MODEL, hashes(2), WorkloadMeta(), 1.0))
            assert gone.result == "not_member"  # a pod that left the policy is asked nothing
        finally:
            peers.agent.close()


class Served:
    """A peer server in this process over a pool holding ``blocks`` (for what a real client cannot make it do)."""

    def __init__(self, blocks: list[bytes], hold_seconds: float = 2.0) -> None:
        from kvpool_sidecar.peers.agent import PeerAgent
        from kvpool_sidecar.peers.host import pool_keys
        from kvpool_sidecar.peers.server import PeerServer

        self.storage = KVStorage(SHAPE, PS, pages=16, shared=True)
        self.sidecar = Sidecar(SidecarConfig.model_validate(CONFIG), 16, storage=self.storage,
                               transfer_keys=CLUSTER_KEYS)
        pool = self.sidecar.pool
        pool.admit("fill", block_hashes=pool_keys(MODEL, blocks), num_tokens=len(blocks) * PS)
        pool.commit("fill", len(blocks) * PS)
        pool.release("fill")
        kv = self.storage.kv
        self.agent = PeerAgent(kv.data_ptr(), kv.numel() * kv.element_size())
        self.server = PeerServer(self.sidecar, self.agent, CLUSTER_KEYS, 0, "127.0.0.1", hold_seconds)

    async def connect(self, secret: bytes = CLUSTER_KEYS.signing[1]):
        """A raw client through the handshake: (reader, writer, the server's accept or refusal)."""
        from kvpool_sidecar.peers.server import _read

        reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port)
        challenge = await _read(reader, protocol.MAX_FRAME)
        mine = protocol.nonce()
        writer.write(protocol.frame(protocol.Proof(protocol.PROTOCOL, "k1", mine, protocol.proof(
            secret, b"client", challenge.nonce, mine))))
        answer = await _read(reader, protocol.MAX_FRAME)
        if isinstance(answer, protocol.Accept):
            assert protocol.proved(secret, b"server", challenge.nonce, mine, answer.tag)
        return reader, writer, answer

    def close(self) -> None:
        self.agent.close()
        self.sidecar.close()
        self.storage.close()


@needs_nixl
def test_a_reader_that_never_says_done_loses_the_hold_at_its_bound_and_its_connection():
    from kvpool_sidecar.peers.server import _read

    served = Served(hashes(3, "held"), hold_seconds=0.2)

    async def go():
        await served.server.start()
        progress = asyncio.create_task(served.server.serve_until_cancelled())
        reader, writer, accept = await served.connect()
        assert isinstance(accept, protocol.Accept)
        writer.write(protocol.frame(protocol.Fetch(MODEL, hashes(4, "held"), wire.Meta())))
        offer = await _read(reader, protocol.MAX_FRAME)
        assert isinstance(offer, protocol.Offer) and len(offer.pages) == 3
        assert len(served.sidecar.pool.sequences.live) == 1  # held: in use, never evicted nor rewritten
        start = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 2) == b""  # closed at the bound
        assert 0.1 < time.monotonic() - start < 1.0
        await asyncio.sleep(0.05)
        assert not served.sidecar.pool.sequences.live
        served.sidecar.pool.check_invariants()
        writer.close()
        # A reader whose process dies (its connection ends) mid-read: the hold goes at once, not at the bound.
        reader, writer, _ = await served.connect()
        writer.write(protocol.frame(protocol.Fetch(MODEL, hashes(3, "held"), wire.Meta())))
        assert isinstance(await _read(reader, protocol.MAX_FRAME), protocol.Offer)
        assert len(served.sidecar.pool.sequences.live) == 1
        writer.transport.abort()
        await asyncio.sleep(0.05)
        assert not served.sidecar.pool.sequences.live
        served.sidecar.pool.check_invariants()
        progress.cancel()

    try:
        asyncio.run(go())
    finally:
        served.close()


@needs_nixl
def test_a_reader_refuses_a_server_that_cannot_prove_the_key_and_reads_nothing_from_it(monkeypatch):
    from kvpool_sidecar.peers.server import _read

    async def impostor(reader, writer):  # answers any proof with a made-up one and its own agent
        writer.write(protocol.frame(protocol.Challenge(protocol.PROTOCOL, protocol.nonce())))
        await _read(reader, protocol.MAX_FRAME)
        writer.write(protocol.frame(protocol.Accept(b"x" * 32, "impostor", b"meta", protocol.Layout(
            (SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.dtype), PS, SHAPE.bytes_per_page(PS), 16, 0))))
        await writer.drain()
        await reader.read()

    async def go(reader_side: Reader):
        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        peer = ("127.0.0.1", server.sockets[0].getsockname()[1])
        reader_side.peers.client.members = frozenset({peer})
        added = []
        monkeypatch.setattr(reader_side.peers.agent, "add_peer", lambda meta: added.append(meta))
        result = await reader_side.peers.client.fetch(peer, MODEL, hashes(2), WorkloadMeta(), 2.0)
        server.close()
        return result, added

    with Reader() as reader_side:
        result, added = reader_side.loop.run_until_complete(go(reader_side))
        assert result.result == "refused" and not added  # its metadata never reached the agent
        reader_side.assert_clean()


@needs_nixl
def test_concurrent_fetches_from_one_peer_share_one_connection_and_each_gets_its_bytes(source):
    first, second = hashes(3, "both-a"), hashes(2, "both-b")
    kv_first, kv_second = source.fill(first), source.fill(second)
    with Reader(source.address) as reader:
        client = reader.peers.client
        add_peer, added = reader.peers.agent.add_peer, []
        reader.peers.agent.add_peer = lambda meta: added.append(meta) or add_peer(meta)

        async def both():
            return await asyncio.gather(client.fetch(source.address, MODEL, first, WorkloadMeta(), 2.0),
                                        client.fetch(source.address, MODEL, second, WorkloadMeta(), 2.0))

        results = reader.loop.run_until_complete(both())
        assert [r.result for r in results] == ["hit", "hit"] and len(added) == 1  # one handshake
        assert torch.equal(reader.cached_kv(first), kv_first) and torch.equal(reader.cached_kv(second), kv_second)
        reader.assert_clean()
    source.idle()


@needs_nixl
def test_a_fetch_cancelled_mid_read_publishes_nothing_and_leaves_nothing(source):
    blocks = hashes(3, "cancelled")
    kv = source.fill(blocks)
    with Reader(source.address) as reader:
        read = reader.peers.agent.read

        def stop_then_read(*args):  # a first read needs the stopped source to set its connection up: it waits
            os.kill(source.proc.pid, signal.SIGSTOP)
            return read(*args)

        reader.peers.agent.read = stop_then_read

        async def cancel_mid_read():
            task = asyncio.ensure_future(reader.peers.client.fetch(source.address, MODEL, blocks, WorkloadMeta(), 2.0))
            await asyncio.sleep(0.15)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(100):  # what the cancelled fetch left to end (its release)
                if not reader.peers.client._parked:
                    break
                await asyncio.sleep(0.01)
            return task

        try:
            task = reader.loop.run_until_complete(cancel_mid_read())
        finally:
            os.kill(source.proc.pid, signal.SIGCONT)
        if task.cancelled():
            assert reader.sidecar.pool.stats().cached_pages == 0
        else:  # the read was over before the cancel: published with the source's bytes
            assert task.result().result == "hit" and torch.equal(reader.cached_kv(blocks), kv)
        reader.assert_clean()
    source.idle()


class Engine:
    """An engine's scheduler side (the connector's) on a sidecar of this process whose members are ``members``."""

    def __init__(self, *members: tuple[str, int], tenant: str = "default", fetch_wait: float = 1.0,
                 keys: TransferKeys = CLUSTER_KEYS) -> None:
        from support import live_sidecar

        self.path = socket_path()
        self.storage = KVStorage(SHAPE, PS, pages=32, shared=True)
        self.live = live_sidecar(SidecarConfig.model_validate(CONFIG), pages=32, storage=self.storage,
                                 transfer_keys=keys, engine_socket=self.path, peers=frozenset(members))
        self.tenant, self.fetch_wait = tenant, fetch_wait

    def __enter__(self) -> Engine:
        from kvpool_sidecar.engines.link import SidecarLink
        from kvpool_sidecar.engines.scheduler import SchedulerSide

        _, self.sidecar = self.live.__enter__()
        self.link = SidecarLink(self.path, wire.Hello(wire.PROTOCOL, "scheduler", "engine", MODEL))
        self.side = SchedulerSide(self.link, PS, session="e", lookup_wait=0.005, fetch_wait=self.fetch_wait,
                                  default_meta={"tenant": self.tenant})
        return self

    def lookup(self, req: str, blocks: list[bytes], hint: tuple[str, int] | None) -> tuple[int, float, float]:
        """Tokens the pool serves the request, the longest one lookup call took, and the whole wait."""
        params = None if hint is None else {"remote_kv_source": {"remote_host": hint[0], "remote_port": hint[1]}}
        start, longest = time.monotonic(), 0.0
        while True:
            t = time.monotonic()
            got = self.side.matched_tokens(req, blocks, len(blocks) * PS + 1, 0, params)
            longest = max(longest, time.monotonic() - t)
            if got is not None:
                return got, longest, time.monotonic() - start
            assert time.monotonic() - start < 5
            time.sleep(0.002)  # the engine's next step

    def load(self, req: str, tokens: int) -> list[int]:
        """The request's load planned and finished: the pool pages it read."""
        from kvpool_sidecar.engines.scheduler import StepDone

        n = tokens // PS
        self.side.allocated(req, list(range(n + 1)), tokens)
        plan = self.side.plan([(req, list(range(n + 1)), True, tokens, 1)])
        pages = [p for job in plan.loads for p in job.pages]
        self.side.worker_done(StepDone({plan.step: 1}))
        self.side.finished(req)
        self.side.sent({req})
        return pages

    def metric(self, name: str, **labels: str) -> float:
        return self.sidecar.metrics.registry.get_sample_value(name, labels) or 0.0

    def fetches_ended(self) -> float:
        """Fetches this sidecar started that have ended (whatever their result)."""
        return sum(self.metric("kvpool_peer_fetches_total", result=r) for r in ("hit", "partial", "miss",
                                                                                 "timeout", "refused", "error"))

    def assert_clean(self) -> None:
        deadline = time.monotonic() + 5
        while self.sidecar.pool.stats().sequences:
            assert time.monotonic() < deadline, "the engine's sidecar still holds a sequence"
            time.sleep(0.01)
        self.sidecar.pool.check_invariants()

    def __exit__(self, *exc: object) -> None:
        self.link.close()
        self.live.__exit__(None, None, None)
        self.storage.close()


@needs_nixl
def test_a_hinted_lookup_waits_for_the_fetch_across_steps_and_loads_the_peers_bytes(source):
    blocks = hashes(6, "hinted")
    kv = source.fill(blocks)
    with Engine(source.address) as engine:
        assert engine.lookup("plain", blocks, None)[0] == 0  # without the hint: nothing asked of the peer
        engine.load("plain", 0)
        assert engine.metric("kvpool_peer_fetches_total", result="partial") == 0
        assert engine.metric("kvpool_peer_fetches_total", result="hit") == 0
        tokens, longest, waited = engine.lookup("hinted", blocks, source.address)
        assert tokens == 6 * PS  # on this very request: the whole prompt from the peer
        assert longest < 0.1  # the fetch ran across steps: no step waited for it
        pages = engine.load("hinted", tokens)
        assert torch.equal(engine.storage.kv[pages], kv)
        assert engine.metric("kvpool_peer_fetches_total", result="hit") == 1
        engine.assert_clean()
        source.idle()


@needs_nixl
def test_a_hint_of_a_non_member_a_dead_member_or_another_tenant_costs_the_engine_nothing_and_leaves_nothing(
        source):
    blocks = hashes(4, "tenant-x")
    source.fill(blocks, tenant="x")
    dead = ("127.0.0.1", free_port())  # a member whose sidecar is gone
    with Engine(source.address, dead, tenant="y") as engine:
        tokens, _, waited = engine.lookup("stranger", blocks, ("127.0.0.1", 1))
        assert (tokens, engine.metric("kvpool_peer_fetches_total", result="not_member")) == (0, 1)
        assert waited < 0.05  # answered at once: nothing was sent anywhere
        engine.load("stranger", 0)
        assert engine.lookup("dead", blocks, dead)[0] == 0
        assert engine.metric("kvpool_peer_fetches_total", result="error") == 1
        engine.load("dead", 0)
        # Tenant y's request names the peer holding tenant x's pages: it fetches only its own tenant's keys.
        assert engine.lookup("other-tenant", blocks, source.address)[0] == 0
        assert engine.metric("kvpool_peer_fetches_total", result="miss") == 1
        engine.load("other-tenant", 0)
        assert engine.sidecar.pool.stats().cached_pages == 0
        engine.assert_clean()
    source.idle()


@needs_nixl
def test_a_hinted_lookup_on_a_sidecar_without_the_cluster_key_is_refused_by_the_peer_and_computes(source):
    blocks = hashes(2, "keyless")
    source.fill(blocks)
    with Engine(source.address, keys=TransferKeys.parse("k1 " + "w" * 40)) as engine:
        assert engine.lookup("keyless", blocks, source.address)[0] == 0
        assert engine.metric("kvpool_peer_fetches_total", result="refused") == 1
        engine.load("keyless", 0)
        assert engine.sidecar.pool.stats().cached_pages == 0
        engine.assert_clean()
    source.idle()


@needs_nixl
def test_a_stopped_peer_costs_a_hinted_request_its_wait_only_and_the_fetch_lands_for_the_next(source):
    blocks = hashes(3, "late")
    kv = source.fill(blocks)
    with Engine(source.address, fetch_wait=0.2) as engine:
        assert engine.lookup("warm", hashes(1, "none"), source.address)[0] == 0  # connected (a miss)
        engine.load("warm", 0)
        os.kill(source.proc.pid, signal.SIGSTOP)
        try:
            tokens, longest, waited = engine.lookup("stalled", blocks, source.address)
            assert tokens == 0 and 0.2 <= waited < 0.4 and longest < 0.1  # computed after its wait
            assert engine.metric("kvpool_peer_fetch_late_total") == 1
            engine.load("stalled", 0)
        finally:
            os.kill(source.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while engine.fetches_ended() < 2:  # the fetch goes on, and lands
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert engine.lookup("next", blocks, None)[0] == 3 * PS  # the next request: no hint needed
        assert torch.equal(engine.storage.kv[engine.load("next", 3 * PS)], kv)
        engine.assert_clean()
    source.idle()


@needs_nixl  # the source process dies here: the next test starts another
def test_a_source_killed_mid_fetch_costs_a_hinted_request_its_wait_only_and_leaves_nothing(source, monkeypatch):
    """Through the engine's lookup: the offer came and the source holds its pages when it is killed -9,
    before the read. The request computes after its wait (no lookup call blocks), the fetch ends in an
    error or a timeout, nothing is published and no sequence is left."""
    blocks = hashes(4, "killed-engine")
    source.fill(blocks)
    read = peer_agent.PeerAgent.read

    def kill_then_read(agent, *args):
        source.proc.kill()
        source.proc.wait()
        return read(agent, *args)

    monkeypatch.setattr(peer_agent.PeerAgent, "read", kill_then_read)
    with Engine(source.address, fetch_wait=0.2) as engine:
        tokens, longest, waited = engine.lookup("killed", blocks, source.address)
        assert tokens == 0 and waited < 0.5 and longest < 0.1
        engine.load("killed", 0)
        deadline = time.monotonic() + 5
        while engine.fetches_ended() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ended = {r: engine.metric("kvpool_peer_fetches_total", result=r) for r in ("error", "timeout")}
        assert sum(ended.values()) == 1, ended
        assert engine.sidecar.pool.stats().cached_pages == 0  # nothing unwritten was published
        assert engine.lookup("after", blocks, None)[0] == 0
        engine.load("after", 0)
        engine.assert_clean()


@needs_nixl  # last: the module's source process dies here (a later test would start another)
def test_a_source_killed_mid_fetch_costs_a_miss_and_publishes_nothing(source):
    blocks = hashes(5, "killed")
    source.fill(blocks)
    with Reader(source.address) as reader:
        read = reader.peers.agent.read

        def kill_then_read(*args):  # the offer came, the pages are held: the source dies before the read
            source.proc.kill()
            source.proc.wait()
            return read(*args)

        reader.peers.agent.read = kill_then_read
        start = time.monotonic()
        result = reader.fetch(source.address, blocks, budget=1.0)
        assert result.result in ("error", "timeout") and result.pages == 0
        assert time.monotonic() - start < 1.5
        assert reader.sidecar.pool.stats().cached_pages == 0  # nothing unwritten was published
        reader.assert_clean()
        reader.peers.agent.read = read
        assert reader.fetch(source.address, blocks, budget=0.5).result in ("error", "timeout")  # gone for good
        reader.assert_clean()
