"""Page transfer between two live sidecars: export -> import -> the importer hits with identical KV;
corrupt, mismatched, incompatible or oversized imports are refused with nothing changed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch
from kvpool_sidecar.client import TRANSFER_CONTENT_TYPE, SidecarClient, SidecarError
from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.storage import KVStorage, ModelShape, transfer
from support import live_sidecar

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
    with live_sidecar(CONFIG, pages=32, storage=storage(32)) as (url_a, a), \
            live_sidecar(CONFIG, pages=32, storage=storage(32)) as (url_b, b):
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


def _tamper(payload: bytes, **changes: object) -> bytes:
    header, data = transfer.decode(payload)
    header = header.model_copy(update=changes)
    return transfer.encode(header, torch.frombuffer(bytearray(data), dtype=torch.uint8))


@pytest.mark.parametrize(
    ("mangle", "status", "error", "field"),
    [
        (lambda p: p[:-1] + bytes([p[-1] ^ 1]), 400, "corrupt_payload", "header.sha256"),
        (lambda p: p[:-8], 400, "corrupt_payload", "body"),
        (lambda p: b"garbage!" + p[8:], 400, "corrupt_payload", "body"),
        (lambda p: p[:12] + b"[" + p[13:], 400, "corrupt_payload", "header"),
        (lambda p: _tamper(p, tokens=[7] * 16), 400, "hash_mismatch", "header.keys"),
        (lambda p: _tamper(p, meta=transfer.WireMeta(tenant="other")), 400, "hash_mismatch", "header.keys"),
        (lambda p: _tamper(p, page_size=2, num_tokens=8, tokens=PROMPT[:8]), 409, "incompatible_payload",
         "header.page_size"),
        (lambda p: _tamper(p, pages=3), 400, "corrupt_payload", "header"),  # breaks pages = len(keys)
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
    with live_sidecar(CONFIG, pages=32, storage=storage(32)) as (url_a, a), \
            live_sidecar(CONFIG, pages=32, storage=storage(32, ModelShape(2, 2, 8, "float16"))) as (url_b, b):
        fill(url_a, a, "s1", PROMPT)
        before = state(b)
        with SidecarClient(url_a) as src, SidecarClient(url_b) as dst, pytest.raises(SidecarError) as err:
            dst.import_pages(src.export_pages(PROMPT))
        assert (err.value.status, err.value.error, err.value.field) == (409, "incompatible_payload", "header.shape")
        assert same_state(before, state(b))


def test_oversized_and_unfitting_imports_are_refused_unchanged():
    with live_sidecar(CONFIG, pages=32, storage=storage(32)) as (url_a, a), \
            live_sidecar(CONFIG, pages=3, storage=storage(3)) as (url_small, small), \
            live_sidecar(CONFIG, pages=6, storage=storage(6)) as (url_busy, busy):
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
            assert busy.pool.has_sequence("running")


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
