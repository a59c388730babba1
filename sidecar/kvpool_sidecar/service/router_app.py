"""``kvpool-sidecar router``: prefix-affinity routing in front of a policy's inference pods.

The decisions are :class:`kvpool_sidecar.routing.Router`'s (pure); this module adds HTTP, the
membership poll (static list or the Kubernetes API), config hot reload and Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool_sidecar.client import TRANSFER_CONTENT_TYPE
from kvpool_sidecar.config import ConfigError, KVCachePolicySpec, SidecarConfig, parse_config_text
from kvpool_sidecar.routing import REASONS, KeySpec, NoPods, Router
from kvpool_sidecar.service import models as m
from kvpool_sidecar.service.http import ApiError, background, bearer_auth, install_error_handlers, workload_meta
from kvpool_sidecar.service.membership import Endpoint, MembershipSource

log = logging.getLogger("kvpool.router")
WARMED_MEMORY = 4096  # (prefix, replica) pairs remembered as warmed


def key_spec(spec: KVCachePolicySpec) -> KeySpec:
    """Routing keys follow the pods' own hashing: page size, tenant isolation, shared prefixes."""
    return KeySpec(spec.pageSize, spec.tenancy.isolation == "perTenant", frozenset(spec.tenancy.sharedPrefixes))


def key_text(key: Any) -> str | None:
    if key is None:
        return None
    return key.hex() if isinstance(key, bytes) else str(key)


class RouterMetrics:
    def __init__(self, service: RouterService) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("kvpool_router_decisions", "Routing decisions by reason", ["reason"], registry=r)
        self.membership = Counter(
            "kvpool_router_membership_changes", "Pods that joined or left the ring", ["change"], registry=r
        )
        self.reloads = Counter("kvpool_router_config_reloads", "Config reloads by result", ["result"], registry=r)
        self.warmups = Counter(
            "kvpool_router_warmups", "Replica warm-ups (owner pages exported and imported into the replica)",
            ["result"], registry=r,
        )
        self.warmup_pages = Counter("kvpool_router_warmup_pages", "Pages copied into replicas", registry=r)
        self.membership_errors = Counter(
            "kvpool_router_membership_errors", "Failed membership polls (the last members were kept)", registry=r
        )
        for reason in REASONS:
            self.decisions.labels(reason)
        for change in ("join", "leave"):
            self.membership.labels(change)
        for result in ("applied", "invalid"):
            self.reloads.labels(result)
        for result in ("copied", "nothing_to_copy", "failed"):
            self.warmups.labels(result)
        r.register(_RouterCollector(service))


class _RouterCollector(Collector):
    def __init__(self, service: RouterService) -> None:
        self._service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._service
        now = s.clock()
        yield GaugeMetricFamily("kvpool_router_pods", "Pods on the ring", value=len(s.router.pods))
        load = GaugeMetricFamily("kvpool_router_pod_load", "Requests routed to a pod, decayed over "
                                 "routing.loadWindow", labels=["pod"])
        for pod, value in s.router.loads(now).items():
            load.add_metric([pod], value)
        yield load
        yield GaugeMetricFamily("kvpool_router_hot_prefixes", "Prefixes above routing.hotPrefixQPS",
                                value=s.router.hot_prefixes(now))


class RouterService:
    def __init__(
        self,
        config: SidecarConfig,
        source: MembershipSource,
        *,
        mode: str = "bounded-hash+replicas",
        config_path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        warm_replicas: bool = False,
        sidecar_token: str | None = None,
        warm_retry_seconds: float = 5.0,
        health_path: str | None = None,
        health_timeout: float = 1.0,
    ) -> None:
        spec = config.spec()
        self.router = Router(spec.routing, key_spec(spec), mode=mode)
        self.source = source
        self.urls: dict[str, Endpoint] = {}
        self.clock = clock
        self.config_path = Path(config_path) if config_path else None
        self.config_digest = hashlib.sha256(self.config_path.read_bytes()).hexdigest() if self.config_path else ""
        self.metrics = RouterMetrics(self)
        self.warm_replicas = warm_replicas
        self.warm_retry_seconds = warm_retry_seconds  # after an empty or failed warm-up
        self.sidecar_token = sidecar_token
        self._warmed: OrderedDict[tuple[Any, str], float] = OrderedDict()  # -> when a next try may start
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None
        # Static pods are probed (a Kubernetes pod list carries readiness already): a pod whose engine
        # does not answer health_path is off the ring until it answers again.
        self.health_path = health_path
        self.health_timeout = health_timeout
        self.listed = 0  # members the source names, usable or not

    # ---------------------------------------------------------------------------- membership
    def apply_members(self, members: dict[str, Endpoint]) -> None:
        joined, left = self.router.set_pods(list(members))
        self.urls = dict(members)
        if joined or left:
            log.info("members: %d pods (joined %s, left %s)", len(members), joined or "-", left or "-")
        self.metrics.membership.labels("join").inc(len(joined))
        self.metrics.membership.labels("leave").inc(len(left))

    async def poll_members(self) -> None:
        try:
            members = await asyncio.to_thread(self.source.members)
        except Exception as exc:  # an API hiccup keeps the ring as it is
            self.metrics.membership_errors.inc()
            log.warning("membership poll failed, keeping %d pods: %s", len(self.urls), exc)
            return
        self.listed = len(members)
        if self.health_path is not None and members:
            alive = await asyncio.gather(*(self._healthy(e.url) for e in members.values()))
            down = [pod for pod, ok in zip(members, alive, strict=True) if not ok]
            if down:
                log.warning("pods not answering %s, off the ring until they do: %s", self.health_path, down)
            members = {pod: e for (pod, e), ok in zip(members.items(), alive, strict=True) if ok}
        self.apply_members(members)

    async def _healthy(self, url: str) -> bool:
        try:
            assert self._http is not None
            answer = await self._http.get(url.rstrip("/") + str(self.health_path), timeout=self.health_timeout)
        except (httpx.HTTPError, OSError):
            return False
        return answer.status_code < 500

    # -------------------------------------------------------------------------------- config
    def poll_config(self) -> None:
        if self.config_path is None:
            return
        try:
            raw = self.config_path.read_bytes()
        except OSError as exc:
            log.warning("config %s unreadable, keeping the current one: %s", self.config_path, exc)
            return
        digest = hashlib.sha256(raw).hexdigest()
        if digest == self.config_digest:
            return
        self.config_digest = digest
        try:
            spec = parse_config_text(raw.decode()).spec()
        except (ConfigError, UnicodeDecodeError) as exc:
            self.metrics.reloads.labels("invalid").inc()
            log.error("config %s refused, keeping the current one: %s", self.config_path, exc)
            return
        self.router.reconfigure(spec.routing, key_spec(spec))
        self.metrics.reloads.labels("applied").inc()
        log.info("config reloaded: %s", spec.routing.model_dump())

    # -------------------------------------------------------------------------------- routing
    def route(self, body: m.Prompt) -> m.RouteResponse:
        try:
            decision = self.router.route(body.tokens, block_hashes=body.block_hashes, num_tokens=body.num_tokens,
                                         meta=workload_meta(body.meta), now=self.clock())
        except NoPods:
            raise ApiError(503, "no_pods", "the router has no serving pods to route to") from None
        self.metrics.decisions.labels(decision.reason).inc()
        if decision.reason == "replica" and self.warm_replicas and decision.owner in self.urls:
            self._schedule_warmup(decision.key, self.urls[decision.owner].sidecar_url,
                                  self.urls[decision.pod].sidecar_url, body)
        return m.RouteResponse(
            pod=decision.pod, url=self.urls[decision.pod].url, reason=decision.reason,
            alternates=[m.RouteTarget(pod=p, url=self.urls[p].url) for p in decision.alternates],
            hot=decision.hot, key=key_text(decision.key), owner=decision.owner,
        )

    # ------------------------------------------------------------------------ replica warm-up
    def _schedule_warmup(self, key: Any, owner_url: str, replica_url: str, body: m.Prompt) -> None:
        """The first time a hot prefix lands on a replica, copy the owner's pages there in the background
        (export -> import), so the replica borrows the owner's cache instead of recomputing it."""
        mark = (key, replica_url)
        now = self.clock()
        if self._warmed.get(mark, 0.0) > now:
            return  # warmed already, being warmed, or the owner had nothing a moment ago
        self._warmed[mark] = math.inf
        self._warmed.move_to_end(mark)
        while len(self._warmed) > WARMED_MEMORY:
            self._warmed.popitem(last=False)
        prompt = body.model_dump(exclude_none=True)
        task = asyncio.get_running_loop().create_task(self._warm(mark, owner_url, replica_url, prompt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, mark: tuple[Any, str], owner_url: str, replica_url: str, prompt: dict[str, Any]) -> None:
        http = self._http
        if http is None:
            return
        try:
            exported = await http.post(owner_url + "/v1/transfer/export", json=prompt)
            if exported.status_code == 404:
                self.metrics.warmups.labels("nothing_to_copy").inc()
                self._warmed[mark] = self.clock() + self.warm_retry_seconds
                return
            exported.raise_for_status()
            imported = await http.post(replica_url + "/v1/transfer/import", content=exported.content,
                                       headers={"content-type": TRANSFER_CONTENT_TYPE})
            imported.raise_for_status()
        except httpx.HTTPError as exc:
            self.metrics.warmups.labels("failed").inc()
            self._warmed[mark] = self.clock() + self.warm_retry_seconds
            log.warning("warming %s from %s failed: %s", replica_url, owner_url, exc)
            return
        self.metrics.warmups.labels("copied").inc()
        self.metrics.warmup_pages.inc(imported.json().get("imported_pages", 0))

    async def start(self) -> None:
        headers = {"authorization": f"Bearer {self.sidecar_token}"} if self.sidecar_token else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=30.0)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def pods(self) -> m.PodsResponse:
        loads = self.router.loads(self.clock())
        return m.PodsResponse(mode=self.router.mode, pods=[
            m.PodView(pod=p, url=self.urls[p].url, sidecar_url=self.urls[p].sidecar_url, load=loads.get(p, 0.0))
            for p in self.router.pods
        ])


def create_router_app(service: RouterService, *, membership_interval: float = 5.0,
                      config_interval: float = 1.0, token: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        await service.poll_members()
        jobs = [_every(membership_interval, service.poll_members)]
        if service.config_path is not None:
            async def config() -> None:
                service.poll_config()

            jobs.append(_every(config_interval, config))
        try:
            async with background(jobs):
                yield
        finally:
            await service.stop()

    app = FastAPI(title="kvpool router", version="0.1.0", lifespan=lifespan,
                  description="Sends each request to the inference pod that caches its prefix, with bounded load.")
    install_error_handlers(app)

    v1 = [Depends(bearer_auth(token))]

    @app.post("/v1/route", response_model=m.RouteResponse, tags=["routing"], dependencies=v1,
              responses={503: {"model": m.ErrorResponse}, 422: {"model": m.ErrorResponse}})
    async def route(body: m.Prompt) -> m.RouteResponse:
        """The pod for this prompt (tokens or block hashes + workload metadata), the alternates and why."""
        return service.route(body)

    @app.get("/v1/pods", response_model=m.PodsResponse, tags=["routing"], dependencies=v1)
    async def pods() -> m.PodsResponse:
        return service.pods()

    @app.get("/healthz", tags=["status"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["status"], responses={503: {"model": m.ErrorResponse}})
    async def readyz() -> dict[str, Any]:
        if not service.router.pods:
            raise ApiError(503, "no_pods", f"none of the {service.listed} listed pods is serving")
        return {"status": "ready", "pods": len(service.router.pods), "listed": service.listed}

    @app.get("/metrics", tags=["status"], include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _every(interval: float, step: Callable[[], Any]) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await step()
        except Exception:  # a poller must outlive any surprise; the error is logged
            log.exception("periodic task failed")
