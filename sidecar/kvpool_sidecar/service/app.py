"""The FastAPI application: routes, error shapes, auth, background reload and pre-eviction."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import watchfiles
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool_sidecar.config import ConfigError, SidecarConfig, validate_config
from kvpool_sidecar.pool import DEFAULT_TENANT, PoolError, WorkloadMeta
from kvpool_sidecar.service import models as m
from kvpool_sidecar.service.credentials import ADMIN, Credentials, Principal
from kvpool_sidecar.service.state import Sidecar
from kvpool_sidecar.storage import transfer

log = logging.getLogger("kvpool.sidecar")
DEFAULT_MAX_BODY_BYTES = 16 << 20  # a 2M-token prompt as JSON is about 14 MB
PRE_EVICT_BATCH = 256  # pages per idle step (about a millisecond): a request never waits long behind one
IDLE_SECONDS = 0.5
# A file event is acted on once writes have paused this long (a writer's chunks arrive closer together),
# and at the latest this long after the first; the watch thread wakes this often to see a shutdown.
EVENT_SETTLE_MS, EVENT_MAX_WAIT_MS, EVENT_WAKE_MS = 50, 400, 250


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str, field: str = "") -> None:
        self.status, self.error, self.detail, self.field = status, error, detail, field


def _error(status: int, error: str, detail: str, field: str = "") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail, "field": field})


def workload_meta(meta: m.Meta) -> WorkloadMeta:
    return WorkloadMeta(meta.workload_class, meta.request_type, meta.turn, meta.tenant, meta.user)


def _error_name(exc: PoolError) -> str:
    name = type(exc).__name__
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


TRANSFER_STATUS = {"not_cached": 404, "no_storage": 404, "corrupt_payload": 400, "hash_mismatch": 400,
                   "incompatible_payload": 409, "too_large": 413, "unknown_key": 403, "bad_signature": 403,
                   "expired_payload": 403, "no_transfer_key": 503}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": m.ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}


@contextlib.asynccontextmanager
async def background(jobs: list[Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    """Run ``jobs`` as tasks for the duration; cancel and await them on the way out."""
    tasks = [asyncio.create_task(job) for job in jobs]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BodyLimit:
    """Refuse a body past its limit (413, before it is parsed): by its Content-Length; a body without
    one (chunked) is read up to the limit first, then handed on whole."""

    def __init__(self, app: Any, limit: Callable[[str], int]) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        too_large = _error(413, "too_large", f"the body is larger than this endpoint's limit of {limit} bytes "
                           "(--max-body-bytes; an import: the pool's size)", "body")
        length = next((value for name, value in scope.get("headers", ()) if name == b"content-length"), None)
        if length is not None:
            if length.isdigit() and int(length) > limit:
                await too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the body to its length
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            seen += len(message.get("body", b""))
            if seen > limit:
                await too_large(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay() -> dict[str, Any]:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return whole

        await self.app(scope, replay, send)


def bearer_auth(token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency that requires ``Authorization: Bearer <token>`` (nothing when ``token`` is None)."""
    check = authenticate(as_credentials(token))

    async def authorize(request: Request) -> None:
        await check(request)

    return authorize


def as_credentials(token: str | Credentials | None) -> Credentials | None:
    """One bare token is the admin's (the single-token form); credentials pass as they are."""
    return Credentials([(token.encode(), ADMIN)]) if isinstance(token, str) else token


def authenticate(credentials: Credentials | None) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency naming the caller from its bearer token (loopback without a token file: admin)."""

    async def who(request: Request) -> Principal:
        if credentials is None:
            return ADMIN
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        principal = credentials.who(given) if scheme.lower() == "bearer" else None
        if principal is None:
            raise ApiError(401, "unauthorized", "a valid bearer token is required", "authorization")
        return principal

    return who


def require(who: Principal, *roles: str, what: str) -> None:
    if who.role not in roles:
        raise ApiError(403, "forbidden", f"{what} needs the {' or '.join(roles)} role; this credential is {who}",
                       "authorization")


def meta_for(who: Principal, meta: m.Meta) -> WorkloadMeta:
    """The request's workload metadata, its tenant checked against the credential's."""
    wm = workload_meta(meta)
    if who.role != "tenant" or meta.tenant == who.tenant:
        return wm
    if meta.tenant == DEFAULT_TENANT:  # not named: the credential's own
        return WorkloadMeta(wm.workload_class, wm.request_type, wm.turn, str(who.tenant), wm.user)
    raise ApiError(403, "forbidden", f"this credential acts for tenant {who.tenant!r} only", "meta.tenant")


def install_error_handlers(app: FastAPI) -> None:
    """Every error answers ``{"error", "detail", "field"}`` with the status the API documents."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.error, exc.detail, exc.field)

    @app.exception_handler(PoolError)
    async def _pool_error(_: Request, exc: PoolError) -> JSONResponse:
        return _error(exc.status, _error_name(exc), str(exc), exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")]
        if first.get("type") == "json_invalid":
            return _error(400, "invalid_json", f"the body is not valid JSON: {first.get('msg')}", "body")
        if first.get("type") == "model_attributes_type" and not loc:
            detail = "the body must be a JSON object (Content-Type: application/json)"
            return _error(400, "invalid_json", detail, "body")
        msg = first.get("msg", "invalid").removeprefix("Value error, ")
        return _error(422, "invalid_request", msg, ".".join(loc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error(exc.status_code, "http_error", str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route's methods; a path may have several routes.
            methods = sorted({meth for route in app.routes if getattr(route, "path", None) == request.url.path
                              for meth in getattr(route, "methods", ()) or ()} - {"HEAD"})
            response.headers["allow"] = ", ".join(methods)
        return response


def create_app(
    sidecar: Sidecar, *, token: str | Credentials | None = None, serve_metrics: bool = True, poll_interval: float = 0.5,
    pre_evict_interval: float = 1.0, on_shutdown: Callable[[], None] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        jobs = []
        if sidecar.config_path is not None:
            jobs += [_config_file_events(sidecar), _poll_config(sidecar, poll_interval)]
        if pre_evict_interval > 0:
            jobs.append(_pre_evict_when_idle(sidecar, pre_evict_interval))
        try:
            async with background(jobs):
                yield
        finally:
            # Here, not after uvicorn returns: on SIGTERM uvicorn re-raises the signal once it has shut
            # down, and the process ends before any code after it runs (the shared segment would stay).
            if on_shutdown is not None:
                on_shutdown()

    app = FastAPI(
        title="kvpool sidecar",
        version="0.1.0",
        description="Paged KV-cache pool of one inference pod: prefix reuse, pins, partitions, eviction.",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )

    install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=lambda path: sidecar.max_body_bytes(path, max_body_bytes))

    auth = authenticate(as_credentials(token))
    v1 = [Depends(auth)]

    @app.post("/v1/sequences", response_model=m.AdmitResponse, dependencies=v1, tags=["sequences"])
    async def admit(body: m.AdmitRequest, who: Principal = Depends(auth)) -> m.AdmitResponse:
        adm = await sidecar.run(
            sidecar.admit, body.seq_id, body.tokens, body.block_hashes, body.num_tokens, meta_for(who, body.meta),
            heavy=sidecar.is_heavy(body.tokens, body.block_hashes, body.num_tokens), owner=who,
        )
        return m.AdmitResponse(seq_id=adm.seq_id, num_cached_tokens=adm.num_cached_tokens, page_ids=adm.page_ids,
                               storage_epoch=sidecar.storage_epoch)

    @app.post("/v1/sequences/{seq_id}/commit", response_model=m.CommitResponse, dependencies=v1, tags=["sequences"])
    async def commit(seq_id: str, body: m.CommitRequest, who: Principal = Depends(auth)) -> m.CommitResponse:
        sidecar.check_owner(who, seq_id)
        published = await sidecar.run(sidecar.pool.commit, seq_id, body.num_computed_tokens)
        return m.CommitResponse(seq_id=seq_id, published_pages=published)

    @app.post("/v1/sequences/{seq_id}/append", response_model=m.AppendResponse, dependencies=v1, tags=["sequences"])
    async def append(seq_id: str, body: m.AppendRequest, who: Principal = Depends(auth)) -> m.AppendResponse:
        sidecar.check_owner(who, seq_id)
        new = await sidecar.run(sidecar.with_evictions, sidecar.pool.append, seq_id, body.num_new_tokens)
        return m.AppendResponse(seq_id=seq_id, new_page_ids=new)

    @app.post("/v1/sequences/{seq_id}/fork", response_model=m.ForkResponse, dependencies=v1, tags=["sequences"])
    async def fork(seq_id: str, body: m.ForkRequest, who: Principal = Depends(auth)) -> m.ForkResponse:
        sidecar.check_owner(who, seq_id)
        res = await sidecar.run(sidecar.fork, seq_id, body.new_seq_id, owner=who)
        return m.ForkResponse(seq_id=res.seq_id, page_ids=res.page_ids, copy_src=res.copy_src, copy_dst=res.copy_dst)

    @app.delete("/v1/sequences/{seq_id}", status_code=204, dependencies=v1, tags=["sequences"])
    async def release(seq_id: str, who: Principal = Depends(auth)) -> Response:
        sidecar.check_owner(who, seq_id)
        await sidecar.run(sidecar.release, seq_id)
        return Response(status_code=204)

    @app.post("/v1/batch", response_model=m.BatchResponse, dependencies=v1, tags=["sequences"])
    async def batch(body: m.BatchRequest, who: Principal = Depends(auth)) -> m.BatchResponse:
        heavy = any(
            op.op == "admit" and sidecar.is_heavy(op.tokens, op.block_hashes, op.num_tokens) for op in body.ops
        )
        if body.report is not None:
            r = body.report
            sidecar.metrics.observe_engine_report(r.loaded_tokens, r.saved_tokens, r.lookup_seconds, r.failures)
        return await sidecar.run(_apply_batch, sidecar, body.ops, who, heavy=heavy)

    @app.post("/v1/lookup", response_model=m.LookupResponse, dependencies=v1, tags=["sequences"])
    async def lookup(body: m.Prompt, who: Principal = Depends(auth)) -> m.LookupResponse:
        n = await sidecar.run(
            sidecar.pool.lookup, body.tokens, block_hashes=body.block_hashes, num_tokens=body.num_tokens,
            meta=meta_for(who, body.meta),
        )
        return m.LookupResponse(num_cached_tokens=n)

    @app.post("/v1/pins", response_model=m.PinResponse, status_code=201, dependencies=v1, tags=["pins"])
    async def pin(body: m.PinRequest, who: Principal = Depends(auth)) -> m.PinResponse:
        if body.seq_id is not None:
            sidecar.check_owner(who, body.seq_id)
        record = await sidecar.run(
            sidecar.pin, body.tokens, block_hashes=body.block_hashes, seq_id=body.seq_id,
            meta=meta_for(who, body.meta), ttl=body.ttl_seconds, owner=who,
        )
        return m.PinResponse(pin_id=record.pin_id, pages=list(record.pages), expires_at=record.expires_at)

    @app.delete("/v1/pins/{pin_id}", status_code=204, dependencies=v1, tags=["pins"])
    async def unpin(pin_id: str, who: Principal = Depends(auth)) -> Response:
        await sidecar.run(sidecar.unpin, pin_id, who)
        return Response(status_code=204)

    @app.get("/v1/stats", dependencies=v1, tags=["status"])
    async def stats() -> dict[str, Any]:
        return await sidecar.run(sidecar.stats)

    @app.get("/v1/config", response_model=m.ConfigView, dependencies=v1, tags=["config"])
    async def get_config() -> dict[str, Any]:
        return sidecar.config_view()

    @app.put("/v1/config", response_model=m.ConfigView, dependencies=v1, tags=["config"],
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/SidecarConfig"}}}}})
    async def put_config(request: Request, who: Principal = Depends(auth)) -> dict[str, Any]:
        require(who, "admin", what="changing the config")
        # Validated by the same function as the file, so both name the field and rule alike.
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "invalid_json", "the body is not valid JSON", "body") from None
        try:
            config = validate_config(body)
        except ConfigError as exc:
            await sidecar.run(sidecar.reject, f"PUT /v1/config: {exc}")
            raise ApiError(422, "invalid_config", str(exc), exc.field) from None
        _, error, field = await sidecar.run(sidecar.apply_config, config, "PUT /v1/config", heavy=True)
        if error:
            # Valid, but refused by the running pool (a page-size change needs a restart): a conflict.
            raise ApiError(409, "config_refused", error, field)
        return sidecar.config_view()

    @app.get("/v1/storage/handle", dependencies=v1, tags=["storage"])
    async def storage_handle(who: Principal = Depends(auth)) -> dict[str, Any]:
        """What the engine needs to map the pool's KV tensor (see kvpool_sidecar.storage.tensors)."""
        require(who, "admin", "engine", what="mapping the pool")
        if sidecar.storage is None:
            raise ApiError(404, "no_storage", "this sidecar keeps bookkeeping only: start it with --kv-shape")
        try:
            return sidecar.storage.handle()
        except (RuntimeError, NotImplementedError) as exc:
            raise ApiError(404, "no_storage", str(exc)) from None

    @app.exception_handler(transfer.TransferError)
    async def _transfer_error(_: Request, exc: transfer.TransferError) -> JSONResponse:
        return _error(TRANSFER_STATUS.get(exc.reason, 400), exc.reason, str(exc), exc.field)

    @app.post("/v1/transfer/export", dependencies=v1, tags=["transfer"], response_class=Response,
              responses={200: {"description": "the prompt's cached leading pages (kvpool page-transfer payload)",
                               "content": {transfer.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
    async def export_pages(body: m.Prompt, who: Principal = Depends(auth)) -> Response:
        """Export the prompt's cached leading pages (KV and keys) for another sidecar's import."""
        require(who, "admin", "engine", what="exporting pages")
        payload, pages = await sidecar.run(
            sidecar.export_prefix, body.tokens, body.block_hashes, body.num_tokens, workload_meta(body.meta), heavy=True
        )
        return Response(payload, media_type=transfer.CONTENT_TYPE, headers={"x-kvpool-pages": str(pages)})

    @app.post("/v1/transfer/import", response_model=m.ImportResponse, dependencies=v1, tags=["transfer"],
              responses={413: {"model": m.ErrorResponse}, 415: {"model": m.ErrorResponse}},
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def import_pages(request: Request, who: Principal = Depends(auth)) -> m.ImportResponse:
        """Import another sidecar's exported pages: verified, then cached here whole, or refused unchanged.

        The body is an export's payload, sent as application/vnd.kvpool.pages or application/octet-stream.
        """
        require(who, "admin", "engine", what="importing pages")
        kind = request.headers.get("content-type", "").split(";")[0].strip()
        if kind not in (transfer.CONTENT_TYPE, "application/octet-stream"):
            raise ApiError(415, "unsupported_media_type", f"send the export payload as {transfer.CONTENT_TYPE}",
                           "content-type")
        payload = await request.body()
        # Checking the bytes (sha256 of every page) needs no lock: admissions go on meanwhile.
        header, kv = await asyncio.to_thread(sidecar.verify_import, payload)
        result = await sidecar.run(sidecar.import_prefix, header, kv, heavy=True)
        return m.ImportResponse(**result)

    @app.get("/healthz", tags=["status"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["status"])
    async def readyz() -> dict[str, str]:
        # The sidecar starts only with a valid config and never drops it: once serving, it is ready.
        return {"status": "ready", "config_hash": sidecar.state.hash}

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
        async def metrics() -> Response:
            return Response(generate_latest(sidecar.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _apply_batch(sidecar: Sidecar, ops: list, who: Principal = ADMIN) -> m.BatchResponse:
    results = []
    pool = sidecar.pool
    for op in ops:
        try:
            if op.op == "admit":
                adm = sidecar.admit(op.seq_id, op.tokens, op.block_hashes, op.num_tokens, meta_for(who, op.meta),
                                    owner=who)
                out: dict[str, Any] = {"seq_id": adm.seq_id, "num_cached_tokens": adm.num_cached_tokens,
                                       "page_ids": adm.page_ids, "storage_epoch": sidecar.storage_epoch}
            else:
                sidecar.check_owner(who, op.seq_id)
                if op.op == "commit":
                    out = {"seq_id": op.seq_id, "published_pages": pool.commit(op.seq_id, op.num_computed_tokens)}
                elif op.op == "append":
                    out = {"seq_id": op.seq_id,
                           "new_page_ids": sidecar.with_evictions(pool.append, op.seq_id, op.num_new_tokens)}
                else:
                    sidecar.release(op.seq_id)
                    out = {"seq_id": op.seq_id}
            results.append(m.BatchResult(ok=True, result=out))
        except PoolError as exc:
            error = m.ErrorResponse(error=_error_name(exc), detail=str(exc), field=exc.field)
            results.append(m.BatchResult(ok=False, error=error))
        except ApiError as exc:
            results.append(m.BatchResult(ok=False, error=m.ErrorResponse(error=exc.error, detail=exc.detail,
                                                                           field=exc.field)))
    return m.BatchResponse(results=results)


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

    The directory, not the file, is watched: kubelet replaces a ConfigMap's files by renaming a new
    ``..data`` symlink into place, which a watch on the old file would never see. Any failure to watch
    (no inotify, its watch limit reached) leaves the poll to do the job.
    """
    assert sidecar.config_path is not None
    directory = sidecar.config_path.absolute().parent
    try:
        async for _ in watchfiles.awatch(directory, watch_filter=None, step=EVENT_SETTLE_MS,
                                         debounce=EVENT_MAX_WAIT_MS, rust_timeout=EVENT_WAKE_MS):
            try:
                await sidecar.run_background(sidecar.poll_config_file, True, heavy=True)
            except Exception:
                log.exception("config reload on a file event failed")
    except (OSError, RuntimeError) as exc:
        log.warning("cannot watch %s for changes (%s): polling only", directory, exc)


async def _pre_evict_when_idle(sidecar: Sidecar, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
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
