"""The tier's logic without vLLM (``TierSide``, engines/tiering.py): what vLLM's manager cannot show
from outside. The tier through vLLM's own tiering classes is tests/e2e/test_vllm_tier.py."""

from __future__ import annotations

import pytest
import torch
from kvpool_sidecar.engines.tiering import RETRY, TierSide
from kvpool_sidecar.storage.reference import copy_row_runs, row_runs


class CountingKey(bytes):
    """A block hash that counts how often it is compared for equality."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountingKey.compared += 1
        return bytes.__eq__(self, other)

    __hash__ = bytes.__hash__


class NoLink:
    """A link never used: a first scan only records the keys it is asked about."""

    timeout = 1.0
    generation = 0

    def close(self) -> None:
        pass


def test_a_first_scan_of_a_long_prompt_compares_each_key_a_bounded_number_of_times():
    """vLLM's scheduler asks about each of a prompt's chunks on its own thread: 8,192 chunks (a 128k-token
    prompt of 16-token chunks) must not cost a comparison with every key asked before (quadratic: 33
    million comparisons, about half a second in the scheduler's step)."""
    side = TierSide(NoLink(), lambda: None, torch.zeros((1, 8), dtype=torch.uint8), 8, 16, session="s")
    try:
        side.new_request("r", None)
        ks = [CountingKey(i.to_bytes(32, "big")) for i in range(8192)]
        CountingKey.compared = 0
        assert all(side.lookup("r", k) == RETRY for k in ks)
        assert all(side.lookup("r", k) == RETRY for k in ks)  # asked again in the same step
        assert CountingKey.compared <= 2 * len(ks)
    finally:
        side.close()


def test_rows_move_in_runs_to_the_rows_named_and_nowhere_else():
    """Ids consecutive on both sides move as one run; every row lands where its pair says, between
    strided rows too (vLLM's chunks without their padding); an id outside a region is refused."""
    src = torch.arange(10 * 6, dtype=torch.uint8).view(10, 6)[:, :4]  # rows of 4 bytes, 6 apart
    dst = torch.zeros((8, 4), dtype=torch.uint8)
    dst_ids, src_ids = [0, 1, 2, 6, 4, 5], [3, 4, 5, 0, 9, 8]
    assert row_runs(src_ids, dst_ids) == [(3, 0, 3), (0, 6, 1), (9, 4, 1), (8, 5, 1)]
    copy_row_runs(src, src_ids, dst, dst_ids)
    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(dst[d], src[s])
    assert not dst[[3, 7]].any()
    with pytest.raises(IndexError):
        copy_row_runs(src, [0], dst, [8])
    with pytest.raises(IndexError):
        copy_row_runs(src, [-1], dst, [0])
