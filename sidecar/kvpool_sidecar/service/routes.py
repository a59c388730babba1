"""The sidecar's /v1 routes, by area; each router is built over one Sidecar and one authenticator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from kvpool_sidecar.config import ConfigError, validate_config
from kvpool_sidecar.pool import PoolError
from kvpool_sidecar.service import models as m
from kvpool_sidecar.service.credentials import ADMIN, Principal
from kvpool_sidecar.service.http import ApiError, error_name, meta_for, require
from kvpool_sidecar.service.state import Sidecar


def sequence_routes(sidecar: Sidecar, auth: Callable[..., Any]) -> APIRouter:
    """Sequences: admit, commit, append, fork, release, batches and lookups."""
    api = APIRouter()
    v1 = [Depends(auth)]

    @api.post("/v1/sequences", response_model=m.AdmitResponse, dependencies=v1, tags=["sequences"])
    async def admit(body: m.AdmitRequest, who: Principal = Depends(auth)) -> m.AdmitResponse:
        adm = await sidecar.run(
            sidecar.admit, body.seq_id, body.tokens, body.block_hashes, body.num_tokens, meta_for(who, body.meta),
            heavy=sidecar.is_heavy(body.tokens, body.block_hashes, body.num_tokens), owner=who,
        )
        return m.AdmitResponse(seq_id=adm.seq_id, num_cached_tokens=adm.num_cached_tokens, page_ids=adm.page_ids,
                               storage_epoch=sidecar.storage_epoch)

    @api.post("/v1/sequences/{seq_id}/commit", response_model=m.CommitResponse, dependencies=v1, tags=["sequences"])
    async def commit(seq_id: str, body: m.CommitRequest, who: Principal = Depends(auth)) -> m.CommitResponse:
        sidecar.check_owner(who, seq_id)
        published = await sidecar.run(sidecar.pool.commit, seq_id, body.num_computed_tokens)
        return m.CommitResponse(seq_id=seq_id, published_pages=published)

    @api.post("/v1/sequences/{seq_id}/append", response_model=m.AppendResponse, dependencies=v1, tags=["sequences"])
    async def append(seq_id: str, body: m.AppendRequest, who: Principal = Depends(auth)) -> m.AppendResponse:
        sidecar.check_owner(who, seq_id)
        new = await sidecar.run(sidecar.with_evictions, sidecar.pool.append, seq_id, body.num_new_tokens)
        return m.AppendResponse(seq_id=seq_id, new_page_ids=new)

    @api.post("/v1/sequences/{seq_id}/fork", response_model=m.ForkResponse, dependencies=v1, tags=["sequences"])
    async def fork(seq_id: str, body: m.ForkRequest, who: Principal = Depends(auth)) -> m.ForkResponse:
        sidecar.check_owner(who, seq_id)
        res = await sidecar.run(sidecar.fork, seq_id, body.new_seq_id, owner=who)
        return m.ForkResponse(seq_id=res.seq_id, page_ids=res.page_ids, copy_src=res.copy_src, copy_dst=res.copy_dst)

    @api.delete("/v1/sequences/{seq_id}", status_code=204, dependencies=v1, tags=["sequences"])
    async def release(seq_id: str, who: Principal = Depends(auth)) -> Response:
        sidecar.check_owner(who, seq_id)
        await sidecar.run(sidecar.release, seq_id)
        return Response(status_code=204)

    @api.post("/v1/batch", response_model=m.BatchResponse, dependencies=v1, tags=["sequences"])
    async def batch(body: m.BatchRequest, who: Principal = Depends(auth)) -> m.BatchResponse:
        heavy = any(
            op.op == "admit" and sidecar.is_heavy(op.tokens, op.block_hashes, op.num_tokens) for op in body.ops
        )
        if body.report is not None:
            r = body.report
            sidecar.metrics.observe_engine_report(r.loaded_tokens, r.saved_tokens, r.lookup_seconds, r.failures,
                                                  r.events)
        return await sidecar.run(_apply_batch, sidecar, body.ops, who, heavy=heavy)

    @api.post("/v1/lookup", response_model=m.LookupResponse, dependencies=v1, tags=["sequences"])
    async def lookup(body: m.Prompt, who: Principal = Depends(auth)) -> m.LookupResponse:
        n = await sidecar.run(
            sidecar.pool.lookup, body.tokens, block_hashes=body.block_hashes, num_tokens=body.num_tokens,
            meta=meta_for(who, body.meta),
        )
        return m.LookupResponse(num_cached_tokens=n)

    return api


def pin_routes(sidecar: Sidecar, auth: Callable[..., Any]) -> APIRouter:
    """Pins: made and removed by their owner."""
    api = APIRouter()
    v1 = [Depends(auth)]

    @api.post("/v1/pins", response_model=m.PinResponse, status_code=201, dependencies=v1, tags=["pins"])
    async def pin(body: m.PinRequest, who: Principal = Depends(auth)) -> m.PinResponse:
        if body.seq_id is not None:
            sidecar.check_owner(who, body.seq_id)
        if body.model is not None:  # the engine's key space: pages a vLLM engine saved and will look up
            record = await sidecar.run(sidecar.pin_engine_prompt, body.model, body.tokens, ttl=body.ttl_seconds,
                                       owner=who)
        else:
            record = await sidecar.run(
                sidecar.pin, body.tokens, block_hashes=body.block_hashes, seq_id=body.seq_id,
                meta=meta_for(who, body.meta), ttl=body.ttl_seconds, owner=who,
            )
        return m.PinResponse(pin_id=record.pin_id, pages=list(record.pages), expires_at=record.expires_at)

    @api.get("/v1/pins", response_model=m.PinList, dependencies=v1, tags=["pins"])
    async def pins(who: Principal = Depends(auth)) -> m.PinList:
        """The live pins this credential may remove: its own; an admin sees every pin, auto-pins included."""
        records = await sidecar.run(sidecar.pins_of, who)
        return m.PinList(pins=[m.PinInfo(pin_id=r.pin_id, pages=len(r.pages), expires_at=r.expires_at, auto=r.auto)
                               for r in records])

    @api.delete("/v1/pins/{pin_id}", status_code=204, dependencies=v1, tags=["pins"])
    async def unpin(pin_id: str, who: Principal = Depends(auth)) -> Response:
        await sidecar.run(sidecar.unpin, pin_id, who)
        return Response(status_code=204)

    return api


def config_routes(sidecar: Sidecar, auth: Callable[..., Any]) -> APIRouter:
    """Stats, the config and the storage handle."""
    api = APIRouter()
    v1 = [Depends(auth)]

    @api.get("/v1/stats", dependencies=v1, tags=["status"])
    async def stats() -> dict[str, Any]:
        return await sidecar.run(sidecar.stats)

    @api.get("/v1/config", response_model=m.ConfigView, dependencies=v1, tags=["config"])
    async def get_config() -> dict[str, Any]:
        return sidecar.config_view()

    @api.put("/v1/config", response_model=m.ConfigView, dependencies=v1, tags=["config"],
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

    @api.get("/v1/storage/handle", dependencies=v1, tags=["storage"])
    async def storage_handle(who: Principal = Depends(auth)) -> dict[str, Any]:
        """What the engine needs to map the pool's KV tensor (see kvpool_sidecar.storage.tensors)."""
        require(who, "admin", "engine", what="mapping the pool")
        if sidecar.storage is None:
            raise ApiError(404, "no_storage", "this sidecar keeps bookkeeping only: start it with --kv-shape")
        try:
            return sidecar.storage.handle()
        except (RuntimeError, NotImplementedError) as exc:
            raise ApiError(404, "no_storage", str(exc)) from None

    return api


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
            error = m.ErrorResponse(error=error_name(exc), detail=str(exc), field=exc.field)
            results.append(m.BatchResult(ok=False, error=error))
        except ApiError as exc:
            results.append(m.BatchResult(ok=False, error=m.ErrorResponse(error=exc.error, detail=exc.detail,
                                                                           field=exc.field)))
    return m.BatchResponse(results=results)
