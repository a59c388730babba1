"""Page transfer between two live sidecars: export -> import -> the importer hits with identical KV;
corrupt, mismatched, incompatible or oversized imports are refused with nothing changed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from kvpool_sidecar.client import TRANSFER_CONTENT_TYPE, SidecarClient, SidecarError
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.pool import WorkloadMeta
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.storage import KVStorage, ModelShape, transfer
from support import CLUSTER_KEYS, live_sidecar

PAGE = 4
SHAPE = ModelShape(layers=2, kv_heads=2, head_dim=4, dtype="float16")
CONFIG = SidecarConfig.model_validate(
    {"pageSize": PAGE, "eviction": {"policy": "lru"}, "pinning": {"autoPin": {"enabled": False}}}
)
PROMPT = list(range(100, 118))  # 4 full pages + 2 tokens


def storage(pages: int, shape: ModelShape = SHAPE) -> KVStorage:
    return KVStorage(shape, PAGE, pages=pages)


def fill(url: str, side: Sidecar, seq: str, tokens: list[int], tenant: str = "default") -> list[int]:
    """Compute a prompt on a sidecar: admit, write random KV into its pages, commit, release."""
    with SidecarClient(url) as client:
        adm = client.admit(seq, tokens, meta={"tenant": tenant})
        assert side.storage is not None
        gen = torch.Generator().manual_seed(len(seq))
        pages = adm.page_ids
        side.storage.kv[pages] = torch.randn(side.storage.kv[pages].shape, generator=gen).to(torch.float16)
        client.commit(seq, len(tokens))
        client.release(seq)
        return pages


def state(side: Sidecar) -> tuple:
    st = side.pool.stats()
    return st.free_pages, st.cached_pages, st.in_use_pages, side.storage.kv.clone() if side.storage else None


def same_state(a: tuple, b: tuple) -> bool:
    return a[:3] == b[:3] and (a[3] is None or torch.equal(a[3], b[3]))


@pytest.fixture
def pair() -> Iterator[tuple[str, Sidecar, str, Sidecar]]:
    with live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=CLUSTER_KEYS) as (url_a, a), \
            live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=CLUSTER_KEYS) as (url_b, b):
        yield url_a, a, url_b, b


def test_export_then_import_makes_the_importer_hit_with_identical_kv(pair):
    url_a, a, url_b, b = pair
    pages_a = fill(url_a, a, "s1", PROMPT)
    with SidecarClient(url_a) as src, SidecarClient(url_b) as dst:
        assert dst.lookup(PROMPT) == 0
        payload = src.export_pages(PROMPT)
        result = dst.import_pages(payload)
        assert result == {"pages": 4, "imported_pages": 4, "already_cached_pages": 0, "num_tokens": 16}
        assert dst.lookup(PROMPT) == 16  # the importer now serves the prefix
        adm = dst.admit("s2", PROMPT)
        assert adm.num_cached_tokens == 16
        assert a.storage is not None and b.storage is not None
        assert torch.equal(b.storage.gather_pages(adm.page_ids[:4]), a.storage.gather_pages(pages_a[:4]))
        dst.release("s2")
        again = dst.import_pages(payload)  # idempotent: nothing rewritten
        assert again["imported_pages"] == 0 and again["already_cached_pages"] == 4
        metrics = dst.metrics()
    assert 'kvpool_transfer_pages_total{direction="import"} 4.0' in metrics
    b.pool.check_invariants()


def test_a_partly_cached_prefix_imports_only_its_missing_pages(pair):
    url_a, a, url_b, b = pair
    fill(url_a, a, "s1", PROMPT)
    fill(url_b, b, "s2", PROMPT[:8] + [1] * 8)  # the importer holds the first 2 pages already
    with SidecarClient(url_a) as src, SidecarClient(url_b) as dst:
        result = dst.import_pages(src.export_pages(PROMPT))
        assert (result["imported_pages"], result["already_cached_pages"]) == (2, 2)
        assert dst.lookup(PROMPT) == 16


def _tamper(payload: bytes, keys: transfer.TransferKeys = CLUSTER_KEYS, **changes: object) -> bytes:
    """The payload changed and signed again with ``keys`` (by default the cluster's: a peer that holds
    the key but sends a wrong header, which the checks behind the signature must still catch)."""
    header, data = transfer.decode(payload, CLUSTER_KEYS)
    header = header.model_copy(update=changes)
    return transfer.encode(header, torch.frombuffer(bytearray(data), dtype=torch.uint8), keys)


def _edit_header(payload: bytes, old: bytes, new: bytes) -> bytes:
    """Change the header's bytes in transit, keeping the signature (a forger without the key)."""
    at = payload.index(b'{"version"')
    head_len = int.from_bytes(payload[at - 4 : at], "little")
    head = payload[at : at + head_len].replace(old, new)
    assert head != payload[at : at + head_len]
    return payload[: at - 4] + len(head).to_bytes(4, "little") + head + payload[at + head_len :]


ATTACKER = transfer.TransferKeys.parse("k1 " + "a" * 40)  # the cluster's key id, not its secret


@pytest.mark.parametrize(
    ("mangle", "status", "error", "field"),
    [
        (lambda p: p[:-1] + bytes([p[-1] ^ 1]), 400, "corrupt_payload", "header.sha256"),
        (lambda p: p[:-8], 400, "corrupt_payload", "body"),
        (lambda p: b"garbage!" + p[8:], 400, "corrupt_payload", "body"),
        (lambda p: p[:12] + b"[" + p[13:], 403, "bad_signature", "signature"),
        (lambda p: _tamper(p, keys=ATTACKER), 403, "bad_signature", "signature"),  # forged
        (lambda p: _tamper(p, keys=transfer.TransferKeys.parse("k9 " + "s" * 40)), 403, "unknown_key", "key_id"),
        (lambda p: _edit_header(p, b'"tenant":"default"', b'"tenant":"acme"'), 403, "bad_signature", "signature"),
        (lambda p: _tamper(p, issued_at=p and 1.0), 403, "expired_payload", "header.issued_at"),  # a replay
        (lambda p: _tamper(p, tokens=[7] * 16), 400, "hash_mismatch", "header.keys"),
        (lambda p: _tamper(p, meta=transfer.WireMeta(tenant="other")), 400, "hash_mismatch", "header.keys"),
        (lambda p: _tamper(p, page_size=2, num_tokens=8, tokens=PROMPT[:8]), 409, "incompatible_payload",
         "header.page_size"),
        (lambda p: _tamper(p, pages=3), 400, "corrupt_payload", "header"),  # breaks pages = len(keys)
        (lambda p: _tamper(p, sha256="0" * 64), 400, "corrupt_payload", "header.sha256"),
    ],
)
def test_a_bad_import_is_refused_and_changes_nothing(pair, mangle, status: int, error: str, field: str):
    url_a, a, url_b, b = pair
    fill(url_a, a, "s1", PROMPT)
    fill(url_b, b, "s9", list(range(500, 520)))
    before = state(b)
    with SidecarClient(url_a) as src, SidecarClient(url_b) as dst:
        payload = src.export_pages(PROMPT)
        with pytest.raises(SidecarError) as err:
            dst.import_pages(mangle(payload))
        assert (err.value.status, err.value.error, err.value.field) == (status, error, field)
        assert dst.lookup(PROMPT) == 0
        assert 'kvpool_transfer_refused_total{reason="' + error + '"} 1.0' in dst.metrics()
    assert same_state(before, state(b))


def test_an_import_into_another_model_shape_is_refused():
    with live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=CLUSTER_KEYS) as (url_a, a), \
            live_sidecar(CONFIG, pages=32, storage=storage(32, ModelShape(2, 2, 8, "float16")),
                         transfer_keys=CLUSTER_KEYS) as (url_b, b):
        fill(url_a, a, "s1", PROMPT)
        before = state(b)
        with SidecarClient(url_a) as src, SidecarClient(url_b) as dst, pytest.raises(SidecarError) as err:
            dst.import_pages(src.export_pages(PROMPT))
        assert (err.value.status, err.value.error, err.value.field) == (409, "incompatible_payload", "header.shape")
        assert same_state(before, state(b))


def test_oversized_and_unfitting_imports_are_refused_unchanged():
    with live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=CLUSTER_KEYS) as (url_a, a), \
            live_sidecar(CONFIG, pages=3, storage=storage(3), transfer_keys=CLUSTER_KEYS) as (url_small, small), \
            live_sidecar(CONFIG, pages=6, storage=storage(6), transfer_keys=CLUSTER_KEYS) as (url_busy, busy):
        fill(url_a, a, "s1", PROMPT)
        with SidecarClient(url_a) as src:
            payload = src.export_pages(PROMPT)
        with SidecarClient(url_small) as dst, pytest.raises(SidecarError) as err:
            dst.import_pages(payload)
        assert (err.value.status, err.value.error) == (413, "too_large")
        with SidecarClient(url_busy) as dst:
            dst.admit("running", list(range(900, 916)))  # 4 of its 6 pages in use: 4 more do not fit
            before = state(busy)
            with pytest.raises(SidecarError) as err:
                dst.import_pages(payload)
            assert (err.value.status, err.value.error) == (503, "pool_exhausted")  # as for an admission
            assert same_state(before, state(busy))
            assert "running" in busy.pool.sequences.live


def test_export_errors_and_content_type(pair):
    url_a, a, url_b, b = pair
    with SidecarClient(url_a) as src, pytest.raises(SidecarError) as err:
        src.export_pages([1] * 16)
    assert (err.value.status, err.value.error) == (404, "not_cached")
    answer = httpx.post(url_b + "/v1/transfer/import", content=b"x", headers={"content-type": "text/plain"})
    assert answer.status_code == 415 and answer.json()["field"] == "content-type"
    assert TRANSFER_CONTENT_TYPE == transfer.CONTENT_TYPE
    with live_sidecar(CONFIG, pages=8) as (url, _), SidecarClient(url) as plain:
        with pytest.raises(SidecarError) as err:
            plain.export_pages(PROMPT)
        assert (err.value.status, err.value.error) == (404, "no_storage")


def test_block_hash_prompts_transfer_too(pair):
    url_a, a, url_b, b = pair
    hashes = [11, 12, 13]
    with SidecarClient(url_a) as src, SidecarClient(url_b) as dst:
        adm = src.admit("h", block_hashes=hashes, num_tokens=12)
        src.commit("h", 12)
        src.release("h")
        result = dst.import_pages(src.export_pages(block_hashes=hashes, num_tokens=12))
        assert result["imported_pages"] == 3 and dst.lookup(block_hashes=hashes, num_tokens=12) == 12
    assert len(adm.page_ids) == 3


def test_forged_pages_never_reach_a_tenant():
    """The cache-poisoning attack of issue 21: keys computed by the caller, filler KV, its own sha256."""
    import hashlib

    from kvpool_sidecar.pool import chain_token_keys, tenant_salt

    with live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=CLUSTER_KEYS) as (url, side):
        keys = chain_token_keys(PROMPT, PAGE, tenant_salt("acme"))
        filler = torch.full((4, SHAPE.bytes_per_page(PAGE) // 2), 7.0, dtype=torch.float16)
        raw = transfer.kv_bytes(filler)
        header = transfer.TransferHeader(
            page_size=PAGE, shape=transfer.WireShape(layers=2, kv_heads=2, head_dim=4, dtype="float16"), pages=4,
            keys=[transfer.key_text(k) for k in keys], tokens=PROMPT[:16], num_tokens=16,
            meta=transfer.WireMeta(tenant="acme"), sha256=hashlib.sha256(raw).hexdigest())
        before = state(side)
        with SidecarClient(url) as client:
            for forged in (transfer.encode(header, raw, ATTACKER),
                           transfer.MAGIC[:-1] + b"1" + b"\x00" * 8 + raw):  # unsigned, the old framing
                with pytest.raises(SidecarError) as err:
                    client.import_pages(forged)
                assert err.value.status in (400, 403)
            assert client.lookup(PROMPT, meta={"tenant": "acme"}) == 0
        assert same_state(before, state(side))


def test_keys_rotate_and_a_sidecar_without_one_moves_no_pages():
    old, new = CLUSTER_KEYS, transfer.TransferKeys.parse("k2 " + "n" * 40 + "\nk1 " + "s" * 40)
    with live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=old) as (url_a, a), \
            live_sidecar(CONFIG, pages=32, storage=storage(32), transfer_keys=new) as (url_b, b), \
            live_sidecar(CONFIG, pages=32, storage=storage(32)) as (url_c, _):
        fill(url_a, a, "s1", PROMPT)
        with SidecarClient(url_a) as src, SidecarClient(url_b) as dst, SidecarClient(url_c) as keyless:
            payload = src.export_pages(PROMPT)
            assert dst.import_pages(payload)["imported_pages"] == 4  # signed by k1, which b still verifies
            for call in (lambda: keyless.import_pages(payload), lambda: keyless.export_pages(PROMPT)):
                with pytest.raises(SidecarError) as err:
                    call()
                assert (err.value.status, err.value.error) == (503, "no_transfer_key")
            with pytest.raises(SidecarError) as err:
                src.import_pages(dst.export_pages(PROMPT))  # signed by k2, which a does not hold yet
            assert (err.value.status, err.value.error) == (403, "unknown_key")


@pytest.mark.parametrize(("text", "message"), [
    ("", "no key"),
    ("k1 short", "at least 32 bytes"),
    ("k1 " + "s" * 40 + "\nk1 " + "t" * 40, "appears twice"),
    ("k1", "expected 'KEY_ID SECRET'"),
])
def test_a_bad_key_file_is_refused_naming_the_line(text, message):
    with pytest.raises(ValueError, match=message):
        transfer.TransferKeys.parse(text)


def test_fuzzed_payloads_are_refused_whole_and_write_nothing():
    """Any change to a signed payload (a flipped byte anywhere, a cut, an insertion) is refused with a
    TransferError naming the reason, never another exception, and the importer is left as it was."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    exporter = Sidecar(CONFIG, 32, storage=storage(32), transfer_keys=CLUSTER_KEYS)
    importer = Sidecar(CONFIG, 32, storage=storage(32), transfer_keys=CLUSTER_KEYS)
    adm = exporter.pool.admit("s", PROMPT)
    exporter.storage.kv[adm.page_ids] = torch.randn(exporter.storage.kv[adm.page_ids].shape).to(torch.float16)
    exporter.pool.commit("s", len(PROMPT))
    exporter.pool.release("s")
    payload, _ = exporter.export_prefix(PROMPT, None, None, WorkloadMeta())
    before = state(importer)

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.data())
    def refused(data):
        kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(payload) - 1))
        if kind == "flip":
            mangled = payload[:at] + bytes([payload[at] ^ data.draw(st.integers(1, 255))]) + payload[at + 1:]
        elif kind == "cut":
            mangled = payload[:at]
        else:
            mangled = payload[:at] + data.draw(st.binary(min_size=1, max_size=8)) + payload[at:]
        with pytest.raises(transfer.TransferError):
            header, kv = importer.verify_import(mangled)
            importer.import_prefix(header, kv)

    refused()
    assert same_state(before, state(importer)) and importer.pool.lookup(PROMPT) == 0
    header, kv = importer.verify_import(payload)  # the payload itself still imports
    assert importer.import_prefix(header, kv)["imported_pages"] == 4
    exporter.close()
    importer.close()
