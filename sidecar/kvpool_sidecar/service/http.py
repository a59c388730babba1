"""The sidecar app's HTTP plumbing: error shapes, the body limit,
bearer credentials and roles, and background jobs tied to an app's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool_sidecar.pool import DEFAULT_TENANT, PoolError, WorkloadMeta
from kvpool_sidecar.service import models as m
from kvpool_sidecar.service.credentials import ADMIN, Credentials, Principal


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str, field: str = "") -> None:
        self.status, self.error, self.detail, self.field = status, error, detail, field


def error_response(status: int, error: str, detail: str, field: str = "") -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail, "field": field})


def workload_meta(meta: m.Meta) -> WorkloadMeta:
    return WorkloadMeta(meta.workload_class, meta.request_type, meta.turn, meta.tenant, meta.user)


def error_name(exc: PoolError) -> str:
    name = type(exc).__name__
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


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

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        too_large = error_response(413, "too_large", f"the body is larger than the limit of {limit} bytes "
                                   "(--max-body-bytes)", "body")
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


API_ROLES = ("admin", "engine", "tenant")  # the roles the sequence, pin and config routes answer


def authenticate(credentials: Credentials | None,
                 roles: tuple[str, ...] = API_ROLES) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency naming the caller from its bearer token (loopback without a token file: admin) and
    refusing (403) a credential whose role these routes do not serve."""

    async def who(request: Request) -> Principal:
        if credentials is None:
            return ADMIN
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        principal = credentials.who(given) if scheme.lower() == "bearer" else None
        if principal is None:
            raise ApiError(401, "unauthorized", "a valid bearer token is required", "authorization")
        require(principal, *roles, what=f"{request.method} {request.scope['path']}")  # scope: no URL object built
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
        return error_response(exc.status, exc.error, exc.detail, exc.field)

    @app.exception_handler(PoolError)
    async def _pool_error(_: Request, exc: PoolError) -> JSONResponse:
        return error_response(exc.status, error_name(exc), str(exc), exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "path", "query")]
        if first.get("type") == "json_invalid":
            return error_response(400, "invalid_json", f"the body is not valid JSON: {first.get('msg')}", "body")
        if first.get("type") == "model_attributes_type" and not loc:
            detail = "the body must be a JSON object (Content-Type: application/json)"
            return error_response(400, "invalid_json", detail, "body")
        msg = first.get("msg", "invalid").removeprefix("Value error, ")
        return error_response(422, "invalid_request", msg, ".".join(loc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, "http_error", str(exc.detail))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the first route's methods; a path may have several routes.
            methods = sorted({meth for route in app.routes if getattr(route, "path", None) == request.url.path
                              for meth in getattr(route, "methods", ()) or ()} - {"HEAD"})
            response.headers["allow"] = ", ".join(methods)
        return response
