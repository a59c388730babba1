"""The sidecar's FastAPI application: its routes (:mod:`.routes`), status endpoints, and the background
config reload and idle pre-eviction."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import watchfiles
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpool_sidecar.config import SidecarConfig
from kvpool_sidecar.peers.node import Peers
from kvpool_sidecar.service import models as m
from kvpool_sidecar.service.channel import DEFAULT_QUARANTINE, EngineChannel
from kvpool_sidecar.service.credentials import Credentials
from kvpool_sidecar.service.http import (
    ERROR_RESPONSES,
    BodyLimit,
    as_credentials,
    authenticate,
    background,
    error_response,
    install_error_handlers,
)
from kvpool_sidecar.service.routes import config_routes, pin_routes, sequence_routes
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.service.warmup import WARMUP_SECONDS, WarmUp

log = logging.getLogger("kvpool.sidecar")
DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 2M-token prompt as JSON is about 14 MB
PRE_EVICT_BATCH = 256  # pages per idle step (about a millisecond): a request never waits long behind one
IDLE_SECONDS = 0.5
# A file event is acted on once writes have paused this long (a writer's chunks arrive closer together),
# and at the latest this long after the first; the watch thread wakes this often to see a shutdown.
EVENT_SETTLE_MS, EVENT_MAX_WAIT_MS, EVENT_WAKE_MS = 50, 400, 250


def create_app(
    sidecar: Sidecar, *, token: str | Credentials | None = None, serve_metrics: bool = True, poll_interval: float = 0.5,
    pre_evict_interval: float = 1.0, on_shutdown: Callable[[], None] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, engine_socket: str | None = None,
    engine_quarantine: float = DEFAULT_QUARANTINE, peers: Peers | None = None,
    peer_warmup: float = WARMUP_SECONDS) -> FastAPI:
    credentials = as_credentials(token)
    warmup = WarmUp(sidecar, peers.client, peer_warmup) if peers is not None else None
    channel = EngineChannel(sidecar, engine_socket, credentials, engine_quarantine, peers) if engine_socket else None
    app = FastAPI(
        title="kvpool sidecar",
        version="0.1.0",
        description="Paged KV-cache pool of one inference pod: prefix reuse, pins, partitions, eviction.",
        lifespan=_lifespan(sidecar, poll_interval, pre_evict_interval, on_shutdown, channel, peers, warmup),
        responses=ERROR_RESPONSES,
    )

    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    auth = authenticate(credentials)
    app.include_router(sequence_routes(sidecar, auth))
    app.include_router(pin_routes(sidecar, auth))
    app.include_router(config_routes(sidecar, auth))

    @app.get("/healthz", tags=["status"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["status"], responses={503: {"model": m.ErrorResponse}})
    async def readyz() -> Any:
        return readiness(sidecar, warmup)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            config_schema = SidecarConfig.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(config_schema.pop("$defs", {}))
            components["SidecarConfig"] = config_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    if serve_metrics:

        @app.get("/metrics", tags=["status"], include_in_schema=False)
        async def metrics() -> Response:  # off the loop: the snapshot waits for the pool's mutex
            body = await asyncio.to_thread(generate_latest, sidecar.metrics.registry)
            return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


def readiness(sidecar: Sidecar, warmup: WarmUp | None) -> Any:
    """The sidecar starts only with a valid config and never drops it: once serving and past its warm-up from
    peers (bounded: --peer-warmup-seconds), it is ready."""
    if warmup is not None and not warmup.done:
        return error_response(503, "warming_up", "fetching the policy's named prompts from peer sidecars "
                              f"(at most {warmup.budget:g} s, --peer-warmup-seconds)")
    return {"status": "ready", "config_hash": sidecar.state.hash}


def _lifespan(
    sidecar: Sidecar, poll_interval: float, pre_evict_interval: float, on_shutdown: Callable[[], None] | None,
    channel: EngineChannel | None = None, peers: Peers | None = None, warmup: WarmUp | None = None,
) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's background jobs (config watch, idle pre-eviction, the engine channel, the peers) and its
    clean-up."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        jobs = []
        if sidecar.config_path is not None:
            jobs += [_config_file_events(sidecar), _poll_config(sidecar, poll_interval)]
        if pre_evict_interval > 0:
            jobs.append(_pre_evict_when_idle(sidecar, pre_evict_interval))
        if channel is not None:
            await channel.start()  # before the app answers: a ready sidecar's socket exists
            jobs.append(channel.serve_until_cancelled())
        if peers is not None:
            await peers.start()  # before the app answers: a ready sidecar serves its peers
            jobs.append(peers.serve_until_cancelled())
            if warmup is not None:
                jobs.append(warmup.run())  # /readyz waits for it
        try:
            async with background(jobs):
                yield
        finally:
            # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once it has shut
            # down, and the process ends before any code after it runs (the shared segment would stay).
            if on_shutdown is not None:
                on_shutdown()

    return lifespan


async def _poll_config(sidecar: Sidecar, interval: float) -> None:
    """The fallback: a changed file is applied once two polls in a row read the same content."""
    while True:
        try:
            await sidecar.run_background(sidecar.poll_config_file, heavy=True)
        except Exception:  # the watcher must outlive any surprise; the error is logged
            log.exception("config watch failed")
        await asyncio.sleep(interval)


async def _config_file_events(sidecar: Sidecar) -> None:
    """Apply the config file as soon as writes to its directory settle (inotify through watchfiles).

    The directory is watched, not the file: kubelet replaces a ConfigMap's files by renaming a new
    ``..data`` symlink into place, which a watch on the old file would never see. Only events on the
    config file's name or ``..data`` count: a log written beside the config (``serve --config
    ./config.yaml > sidecar.log``) wakes nothing. Any failure to watch (no inotify, its watch limit
    reached) leaves the poll to do the job.
    """
    assert sidecar.config_path is not None
    directory = sidecar.config_path.absolute().parent
    names = {sidecar.config_path.name, "..data"}

    def ours(_: watchfiles.Change, path: str) -> bool:
        return os.path.basename(path) in names

    try:
        async for _ in watchfiles.awatch(directory, watch_filter=ours, step=EVENT_SETTLE_MS,
                                         debounce=EVENT_MAX_WAIT_MS, rust_timeout=EVENT_WAKE_MS):
            try:
                await sidecar.run_background(sidecar.poll_config_file, True, heavy=True)
            except Exception:
                log.exception("config reload on a file event failed")
    except (OSError, RuntimeError) as exc:
        log.warning("cannot watch %s for changes (%s): polling only", directory, exc)


SETTLE_PAGES = 256  # pages per background slice: about a millisecond of the pool's lock


async def _pre_evict_when_idle(sidecar: Sidecar, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        # The to-B share of the hour, and the policy's named prompts pinned once an engine saved them.
        for job in (sidecar.follow_schedule, sidecar.keep_prompts_pinned):
            try:
                await sidecar.run_background(job)
            except Exception:
                log.exception("%s failed", job.__name__)
        # Expired pins lapse and a switched policy takes pages over a slice at a time, busy or not,
        # yielding to requests between slices.
        while True:
            try:
                more = await sidecar.run_background(sidecar.pool.settle, None, SETTLE_PAGES)
            except Exception:
                log.exception("settling the pool (expired pins, a policy handover) failed")
                break
            if not more:
                break
            await asyncio.sleep(0)
        # Small steps while the pool stays idle, yielding to requests between them.
        while time.monotonic() - sidecar.last_activity >= IDLE_SECONDS:
            try:
                freed = await sidecar.run_background(sidecar.pre_evict, PRE_EVICT_BATCH)
            except Exception:
                log.exception("pre-eviction failed")
                break
            if freed < PRE_EVICT_BATCH:
                break
            await asyncio.sleep(0)
