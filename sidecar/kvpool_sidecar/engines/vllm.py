"""``KVPoolConnector``: vLLM's v1 KV connector that makes a kvpool sidecar its second-tier prefix cache.

With :mod:`.tier` (kvpool behind vLLM's own offloading, the GPU path), the only modules that import vllm.
This connector is the path for engines vLLM's offloading refuses (vLLM-CPU); its CUDA half has never run on
a GPU and is opt-in (``untested_cuda``). Load it with::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool_sidecar.engines.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/tmp/kvpool/engine.sock", "token_file": "/var/run/kvpool/token"}}'

With ``"kv_events": true`` (and vLLM's own ``--kv-events-config`` on), kvpool's pages are published in
vLLM's KV event stream as ``BlockStored``/``BlockRemoved`` with ``medium="CPU"``, by vLLM's block hashes
(:mod:`.events`), so a router that reads the stream (llm-d, Dynamo) counts the tier.

A request's tenant and workload class are ``defaults`` of the extra config. A request's own
``kv_transfer_params`` (``tenant``, ``workload_class``, ``request_type``, ``turn``, ``user``; in the OpenAI API
a field of the client's request body) count only with ``trust_request_params: true``, for deployments whose
gateway sets them. The scheduler half is :mod:`.scheduler`, the worker half :mod:`.worker`; this class only
translates vLLM's objects. Both halves talk to the sidecar on its engine channel (``socket``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm import envs
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    hash_block_tokens,
    resolve_none_hash_seed,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvpool_sidecar import wire
from kvpool_sidecar.engines.blocks import LayoutError, check_cuda_path, engine_layers
from kvpool_sidecar.engines.identity import IdentityError, hash_seed_problem, model_identity
from kvpool_sidecar.engines.link import SidecarLink, fetch_welcome
from kvpool_sidecar.engines.scheduler import SchedulerSide
from kvpool_sidecar.engines.settings import parse_settings
from kvpool_sidecar.engines.steps import StepDone, StepPlan
from kvpool_sidecar.engines.worker import WorkerSide
from kvpool_sidecar.routing.kv_events import EventLog, Stored

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.engine")


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    done: StepDone = field(default_factory=StepDone)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVPoolWorkerMetadata)
        return KVPoolWorkerMetadata(StepDone().merge(self.done).merge(other.done))


class KVPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = parse_settings(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) > 1:
            raise LayoutError(
                f"KVPoolConnector does not support pipeline_parallel_size={parallel.pipeline_parallel_size} yet: "
                "a stage holds some of the layers, and the pool's pages are keyed by all of them. Run it with "
                "pipeline_parallel_size=1 (tensor parallelism is supported), or without the connector")
        self.ranks = getattr(parallel, "tensor_parallel_size", 1)  # each writes its share of every page
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        if len(groups) > 1 or any(not isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups):
            # A hybrid model (sliding-window and full-attention layers) comes here as one full-attention
            # group: vLLM turns its hybrid KV cache manager off for a connector without SupportsHMA, so
            # every layer keeps every block and a page is whole. A model whose every layer is sliding-window
            # stays a SlidingWindowSpec group, whose blocks outside the window are vLLM's null block: a
            # load or a save by block ids would write or read the wrong bytes there. Refused.
            raise LayoutError(f"KVPoolConnector supports one full-attention KV cache group; this model has "
                              f"{len(groups)}: {', '.join(kinds)} (a model whose every layer attends through a "
                              "sliding window keeps only its window's blocks: not supported yet, run it without "
                              "the connector; hybrid models are supported)")
        failure_policy = self._kv_transfer_config.kv_load_failure_policy
        if failure_policy != "recompute":
            log.warning("kvpool: kv_load_failure_policy is %r: a failed load fails its request; "
                        "'recompute' makes the engine recompute it instead", failure_policy)
        if (problem := hash_seed_problem(vllm_config)) is not None:
            raise IdentityError(f"KVPoolConnector: {problem}")
        self.model = model_identity(vllm_config, kv_cache_config, self.ranks)
        # Short enough that its sequence ids ("<session>-<n>") stay within the wire's bound.
        session = f"vllm-{(getattr(vllm_config, 'instance_id', '') or 'x')[-48:]}-{secrets.token_hex(4)}"
        publish = self.settings.kv_events and role == KVConnectorRole.SCHEDULER
        if publish and not getattr(vllm_config.kv_events_config, "enable_kv_cache_events", False):
            log.warning("kvpool: kv_events is set but vLLM's KV events are off (--kv-events-config "
                        "enable_kv_cache_events): kvpool publishes none")
            publish = False
        scheduler = role == KVConnectorRole.SCHEDULER
        self._hello = wire.Hello(wire.PROTOCOL, "scheduler" if scheduler else "worker", session, self.model,
                                 self.settings.bearer(), publish, _hashing(vllm_config) if scheduler else None)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            link = SidecarLink(self.settings.socket, self._hello, timeout=self.settings.timeout_s,
                               events=EventLog() if publish else None)
            self._scheduler = SchedulerSide(
                link, self.block_size, session=session, lookup_wait=self.settings.lookup_wait_ms / 1000,
                world_size=self.ranks,
                default_meta=self.settings.defaults.model_dump(),
                trust_request_params=self.settings.trust_request_params,
                fetch_wait=self.settings.peer_fetch_wait_ms / 1000,
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Always: each attention layer waits for its own rows of the step's loads (``wait_for_layer_load``),
        Python that a full CUDA graph's replay skips: under vLLM's default FULL_AND_PIECEWISE mode a
        uniform-decode batch holding a fully cached prompt (scheduled for one token) would replay a full
        graph whose attention reads blocks the load lane is still writing. vLLM then runs PIECEWISE."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a save that does not happen is a future miss, so a request preempted with
        saves pending may finish normally (vLLM recomputes it otherwise). Its queued saves would read its
        freed blocks: :meth:`handle_preemptions` cancels them (reported failed, never committed)."""
        return False

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        hashes = [h if isinstance(h, bytes) else str(h).encode() for h in request.block_hashes]
        lora = request.lora_request
        tokens = self._scheduler.matched_tokens(request.request_id, hashes, request.num_tokens, num_computed_tokens,
                                                request.kv_transfer_params, request,
                                                adapter=lora.lora_name if lora is not None else "")
        return tokens, False

    def take_events(self) -> Iterable[KVCacheEvent]:
        """kvpool's stores and removals since the last step, as vLLM's KV events (vLLM merges them into its
        own stream)."""
        if self._scheduler is None or self._scheduler.events is None:
            return ()
        out: list[KVCacheEvent] = []
        stored = removed = 0
        event_hash = _event_hash()
        for event in self._scheduler.events.take():
            if isinstance(event, Stored):
                out.append(self._block_stored(event))
                stored += len(event.hashes)
            else:
                out.append(BlockRemoved(block_hashes=list(map(event_hash, event.hashes)),
                                        medium=MEDIUM_CPU, group_idx=0))
                removed += len(event.hashes)
        if out:
            self._scheduler.link.record(lambda r: (r.published("stored", stored), r.published("removed", removed)))
        return out

    def _block_stored(self, event: Stored) -> BlockStored:
        """The event vLLM's own block pool would publish for these blocks, with medium CPU."""
        request, bs, first = event.source, self.block_size, event.first_block
        extra: list[tuple[Any, ...] | None] = []
        mm_idx = 0
        for i in range(first, first + len(event.hashes)):
            keys, mm_idx = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        event_hash = _event_hash()
        return BlockStored(
            block_hashes=list(map(event_hash, event.hashes)),
            parent_block_hash=event_hash(event.parent) if event.parent is not None else None,
            token_ids=list(request.all_token_ids[first * bs : (first + len(event.hashes)) * bs]),
            block_size=bs, lora_id=lora.adapter_id if lora else None, medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra), group_idx=0,
        )

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        counts = scheduler_output.num_scheduled_tokens
        scheduled: list[tuple[str, list[int] | None, bool, int, int]] = [
            (new.req_id, new.block_ids[0], True, new.num_computed_tokens, counts[new.req_id])
            for new in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            scheduled.append((req_id, new_ids[0] if new_ids is not None else None, req_id in cached.resumed_req_ids,
                              cached.num_computed_tokens[i], counts[req_id]))
        return KVPoolMetadata(self._scheduler.plan(scheduled, scheduler_output.preempted_req_ids))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVPoolWorkerMetadata):
            self._scheduler.worker_done(meta.done)  # commits first ...
        self._scheduler.sent(connector_output.finished_sending)  # ... then releases, on the same link

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        # True: its saves finish through get_finished (the engine keeps its blocks until then).
        return self._scheduler.finished(request.request_id), None

    # ===================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layers = engine_layers(kv_caches, self._kv_cache_config.num_blocks)
        check_cuda_path(layers, self.settings.untested_cuda)
        socket_path, hello, timeout = self.settings.socket, self._hello, self.settings.timeout_s
        rank = get_tensor_model_parallel_rank() if self.ranks > 1 else 0
        self._worker = WorkerSide(lambda: fetch_welcome(socket_path, hello, timeout), layers, self.block_size,
                                  backend=self.settings.kernels, rank=rank, ranks=self.ranks,
                                  max_save_backlog=self.settings.max_save_backlog_ms / 1000)
        self._worker.attach(strict=True)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KVPoolMetadata)
        if self._worker is not None and kv_connector_metadata.plan.preempted:
            self._worker.preempted(kv_connector_metadata.plan.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata) and self._worker is not None
        if meta.plan.loads:
            self._worker.start_loads(meta.plan.loads)  # queued layer by layer; each layer waits for its own

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # every layer is saved at once in wait_for_save, after the forward pass wrote them

    def wait_for_save(self) -> None:
        """Queues the step's saves (they are written off the forward path and reported when done)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata) and self._worker is not None
        self._worker.save(meta.plan)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, KVPoolMetadata):
            return self._worker.finished(finished_req_ids) or None, None
        return self._worker.finished(finished_req_ids, meta.plan.released, meta.plan.coming) or None, None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        done = self._worker.take_done()
        return KVPoolWorkerMetadata(done) if done is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.finish_loads() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.link.close()


def _hashing(vllm_config: VllmConfig) -> wire.Hashing:
    """How this engine hashes its blocks (vLLM's function and seed, and its own hash of a probe block), so
    that the sidecar can name the engine's pages from token ids, and check that it does so right."""
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    fn = get_hash_fn_by_name(algo)
    seed = resolve_none_hash_seed(fn)  # what vLLM's init_none_hash derives its NONE_HASH from
    bs = vllm_config.cache_config.block_size
    return wire.Hashing(algo, seed, bytes(hash_block_tokens(fn, BlockHash(fn(seed)), range(bs), None)))


def _int_hash(h: bytes) -> int:
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _event_hash() -> Any:
    """vLLM's own conversion of a block hash for its events (``maybe_convert_block_hash``: the low 64 bits
    as an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), decided once per batch: vLLM's function reads
    the environment on every call, most of the events' cost."""
    return _int_hash if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES else bytes
