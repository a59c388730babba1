"""``KVPoolTier``: kvpool as a secondary tier of vLLM's own KV offloading (the GPU path).

vLLM moves the bytes between the GPU and its CPU primary tier; kvpool keeps what cascades out of that
tier and promotes it back (:mod:`.tiering`, the logic). Load it in ``TieringOffloadingSpec``'s
``secondary_tiers``::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 4294967296, "block_size": 64,
            "secondary_tiers": [{"type": "KVPoolTier", "module_path": "kvpool_sidecar.engines.tier",
                                 "socket": "/tmp/kvpool/engine.sock", "token_file": "/var/run/kvpool/token"}]}}'

Besides the keys vLLM reads itself (``type``, ``module_path``, ``backpressure``) the entry takes the
connector's channel settings (``socket``, ``token``/``token_file``, ``lookup_wait_ms``, ``timeout_s``,
``defaults``, ``trust_request_params``) and vLLM's ``locality``, which vLLM passes every tier
(:class:`~.settings.TierSettings`); a bad one refuses to start, naming ``secondary_tiers.<field>``. The
sidecar's ``pageSize`` must be the offloaded chunk's tokens (the offloaded group's block size times
vLLM's blocks per chunk: ``block_size`` in vLLM's config) and its ``--kv-shape`` the model's (kv_heads of
all ranks together): a page then holds one chunk, every worker's share of it.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec
import numpy as np
import torch
from typing_extensions import override
from vllm.config import VllmConfig, get_current_vllm_config_or_none
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens, resolve_none_hash_seed
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvpool_sidecar import wire
from kvpool_sidecar.engines.blocks import LayoutError
from kvpool_sidecar.engines.identity import IdentityError, chunk_identity, hash_seed_problem
from kvpool_sidecar.engines.link import Refused, SidecarDown, SidecarLink, fetch_welcome
from kvpool_sidecar.engines.settings import parse_tier_settings
from kvpool_sidecar.engines.tiering import HIT, MISS, TierSide
from kvpool_sidecar.routing.kv_events import EventLog, Removed
from kvpool_sidecar.storage.tensors import ModelShape

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvpool.engine")
CRYPTO_HASHES = ("sha256", "sha256_cbor")  # seeded the same in every process (the others are not, by default)
WHERE = "kv_connector_extra_config.secondary_tiers[KVPoolTier]"
_RESULTS = {HIT: LookupResult.HIT, MISS: LookupResult.MISS}


class KVPoolTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: BackpressureDetector | None = None, **params: Any) -> None:
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        settings = parse_tier_settings(params, WHERE)
        self.locality = None if settings.locality is None else Locality(settings.locality)
        config = offloading_spec.config
        if len(config.groups) != 1:
            raise LayoutError(f"KVPoolTier stores one KV cache group; this model's offloading has "
                              f"{len(config.groups)} (a hybrid model: use another secondary tier)")
        [group] = config.groups
        self.group_id = group.group_id  # vLLM's keys carry it (its KV cache config's index of the group)
        self.page_size = group.tokens_per_block * config.cache.blocks_per_chunk  # tokens a chunk holds
        copies = 1 if getattr(offloading_spec, "replicated_layout", False) else config.parallel.world_size
        self.page_bytes = offloading_spec.cpu_page_size_per_worker * copies  # a chunk without its padding
        engine = engine_config(offloading_spec)
        if engine is None:
            log.warning("kvpool tier: vLLM's engine config is not on the stack that builds the tier: the chunks' "
                        "identity names the model by its name and weight files only (not its quantization, "
                        "hf_overrides, revision or tokenizer), and the hash seed is not checked")
        elif (problem := hash_seed_problem(engine)) is not None:
            raise IdentityError(f"KVPoolTier: {problem}")
        self.model = chunk_identity(config, engine)
        session = f"vllm-tier-{str(config.engine_id)[-40:]}-{secrets.token_hex(4)}"
        token = settings.bearer(WHERE)
        events = bool(config.enable_kv_cache_events)  # kvpool's pages in vLLM's KV events, as this tier's
        hello = wire.Hello(wire.PROTOCOL, "scheduler", session, self.model, token, events)
        # The pool's handle comes on a connection of its own (the scheduler's owns the session's sequences).
        mapper = wire.Hello(wire.PROTOCOL, "worker", session, self.model, token)
        socket, timeout = settings.socket, settings.timeout_s
        welcome = lambda: fetch_welcome(socket, mapper, timeout)  # noqa: E731
        self._check_pool(welcome)
        primary = torch.from_numpy(np.asarray(primary_kv_view))  # [chunks, row bytes], vLLM's region
        # Pins by token ids need the engine's block hashing in the hello; a chunk hashed once (one hash per
        # chunk) is keyed as vLLM keys that hash's tokens, so the sidecar can name the pages from token ids.
        # vLLM's engine core seeds its hashes (NONE_HASH) after it has built this tier: the link opens no
        # connection until then (but for an op, which vLLM makes only once it serves).
        self._hashing_pending = config.cache.tokens_per_hash == self.page_size
        link = SidecarLink(socket, hello, timeout=timeout, events=EventLog() if events else None,
                           hello_ready=self._hello_ready)
        self.side = TierSide(link, welcome, primary, self.page_bytes,
                             self.page_size, session=session, lookup_wait=settings.lookup_wait_ms / 1000,
                             default_meta=settings.defaults.model_dump(),
                             trust_request_params=settings.trust_request_params,
                             fetch_wait=settings.peer_fetch_wait_ms / 1000)
        self._jobs: dict[int, list[OffloadKey]] = {}

    def _check_pool(self, welcome: Any) -> None:
        """Refuse a sidecar whose pages cannot hold vLLM's chunks (naming both); only warn about one that
        does not answer (the engine serves without the tier until it does)."""
        try:
            handle = welcome().storage
        except (SidecarDown, OSError) as exc:
            log.warning("kvpool tier: the sidecar is not reachable at start-up (%s); serving without it "
                        "until it is", exc)
            return
        except Refused as exc:
            raise LayoutError(f"KVPoolTier: {exc}") from None
        if handle is None:
            raise LayoutError("KVPoolTier: the sidecar keeps no KV storage: start it with --kv-shape")
        if handle["page_size"] != self.page_size:
            raise LayoutError(f"KVPoolTier: the pool's page size is {handle['page_size']} tokens, vLLM's "
                              f"offloaded block_size {self.page_size}: set the policy's pageSize to it")
        pool_bytes = ModelShape(**handle["shape"]).bytes_per_page(handle["page_size"])
        if pool_bytes != self.page_bytes:
            raise LayoutError(f"KVPoolTier: a pool page holds {pool_bytes} bytes, a vLLM chunk {self.page_bytes} "
                              "(every worker's share): --kv-shape must be the model's layers,kv_heads,head_dim,"
                              "dtype (kv_heads of all ranks together)")

    @staticmethod
    def _hash(key: OffloadKey) -> bytes:
        """The block hash of a key of the one group this tier stores (vLLM asks about no other)."""
        return bytes(get_offload_block_hash(key))

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _RESULTS.get(self.side.lookup(req_context.req_id, self._hash(key)), LookupResult.RETRY)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.side.submit_store)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.side.submit_load)

    def _submit(self, job: TransferJob, submit: Callable[[int, str, list[bytes], list[int]], None]) -> None:
        keys = list(job.keys)
        self._jobs[job.job_id] = keys  # its keys, for the report of which succeeded
        submit(job.job_id, job.req_context.req_id, [self._hash(k) for k in keys], [int(c) for c in job.chunk_ids])

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        for done in self.side.finished_jobs():
            keys = self._jobs.pop(done.job_id, [])
            good = [k for k, ok in zip(keys, done.ok, strict=False) if ok]
            success = bool(keys) and len(good) == len(keys)
            out.append(JobResult(done.job_id, success, None if success else good))
        return out

    @override
    def has_pending_work(self) -> bool:
        return self.side.pending()

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        """The pages this engine's lookups and stores found or published in kvpool, and their removals
        from the pool (whoever caused them), as vLLM's offloading events of this tier."""
        events = self.side.link.events
        if events is None:
            return ()
        out = []
        for event in events.take():
            keys = [make_offload_key(h, self.group_id) for h in event.hashes]
            # Every page announced here is announced again when it leaves the pool: vLLM's event tracker
            # keeps a chunk's payload until then (removal_expected, as vLLM's kvcr tier says it).
            out.append(OffloadingEvent(keys, Medium.CPU, isinstance(event, Removed), locality=self.locality,
                                       ownership=self.tier_type, removal_expected=True))
        return out

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        return  # the pool's recency moves with its admissions

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.side.new_request(req_context.req_id, req_context.kv_transfer_params)
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.side.finished(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """After vLLM's manager submitted this step's promotions: the holds of the requests it scheduled
        that no load reads go, then this step's lookups are sent."""
        self.side.scheduled(context.new_req_ids)
        self.side.flush()

    def _hello_ready(self, link: SidecarLink) -> bool:
        """The link's question before it connects (on its thread): once vLLM's engine core has set its
        NONE_HASH, the engine's block hashing goes in the hello (a crypto hash; no other is named) and the
        hello is final."""
        if self._hashing_pending:
            if getattr(kv_cache_utils, "NONE_HASH", None) is None:
                return False
            hashing = engine_hashing(self.page_size)
            if hashing is not None:
                link.hello = msgspec.structs.replace(link.hello, hashing=hashing)
            self._hashing_pending = False
        return True

    @override
    def drain_jobs(self) -> None:
        self.side.drain()

    @override
    def shutdown(self) -> None:
        self.side.close()


def engine_hashing(block_size: int) -> wire.Hashing | None:
    """How this engine core hashes its blocks: the function whose hash of vLLM's NONE_HASH seed is the
    NONE_HASH the engine core set (None before it did, or for a hash seeded at random per process), with
    vLLM's own hash of the probe block of token ids 0..block_size-1."""
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        return None
    for algo in CRYPTO_HASHES:
        fn = get_hash_fn_by_name(algo)
        seed = resolve_none_hash_seed(fn)
        if fn(seed) == none_hash:
            return wire.Hashing(algo, seed, bytes(hash_block_tokens(fn, BlockHash(none_hash), range(block_size), None)))
    return None


def engine_config(offloading_spec: OffloadingSpec) -> VllmConfig | None:
    """The ``VllmConfig`` of the engine whose offloading builds this tier, or None where none is found.

    vLLM hands a secondary tier only its ``OffloadingConfig`` (of the model, its name and KV dtype), and
    its engine core sets no current config around the tier's making (``EngineCore.__init__`` builds the
    ``Scheduler``, whose ``KVConnectorFactory.create_connector`` builds ``OffloadingConnector``, then
    ``OffloadingConnectorScheduler``, then ``TieringOffloadingSpec.get_manager``, then the tier): the
    config is an argument of those callers. It is the one on the stack (or current) whose
    ``kv_connector_extra_config`` is this spec's (vLLM's ``build_offloading_config`` hands that dict on)."""

    def ours(candidate: object) -> bool:
        transfer = getattr(candidate, "kv_transfer_config", None) if isinstance(candidate, VllmConfig) else None
        return transfer is not None and transfer.kv_connector_extra_config == offloading_spec.extra_config

    current = get_current_vllm_config_or_none()
    if ours(current):
        return current
    frame = sys._getframe(1)
    while frame is not None:
        for value in frame.f_locals.values():
            if ours(value):
                return value
        frame = frame.f_back
    return None
