"""A small typed client of the sidecar API, for engines and tests (httpx, synchronous)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class SidecarError(Exception):
    """An error answer: ``status``, ``error`` (a name), ``detail`` and the ``field`` at fault."""

    def __init__(self, status: int, error: str, detail: str, field: str = "") -> None:
        super().__init__(f"{status} {error}: {detail}" + (f" (field {field})" if field else ""))
        self.status, self.error, self.detail, self.field = status, error, detail, field


@dataclass(frozen=True)
class Admitted:
    seq_id: str
    num_cached_tokens: int
    page_ids: list[int]
    storage_epoch: int | None = None  # the KV storage the page ids index (None: bookkeeping only)


@dataclass(frozen=True)
class Forked:
    seq_id: str
    page_ids: list[int]
    copy_src: int
    copy_dst: int


class SidecarClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout: float = 10.0) -> None:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.base_url, self.token, self.timeout = base_url, token, timeout
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self._http.request(method, path, json=body)
        self._raise_for(response)
        return response.json() if response.content else None

    @staticmethod
    def _raise_for(response: httpx.Response) -> None:
        if response.status_code >= 400:
            try:
                err = response.json()
            except ValueError:
                err = {"error": "http_error", "detail": response.text}
            raise SidecarError(response.status_code, err.get("error", ""), err.get("detail", ""), err.get("field", ""))

    @staticmethod
    def _prompt(tokens: Sequence[int] | None, block_hashes: Sequence[int | str] | None, num_tokens: int | None,
                meta: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if tokens is not None:
            body["tokens"] = list(tokens)
        if block_hashes is not None:
            body["block_hashes"] = list(block_hashes)
        if num_tokens is not None:
            body["num_tokens"] = num_tokens
        if meta:
            body["meta"] = meta
        return body

    def admit(
        self, seq_id: str, tokens: Sequence[int] | None = None, *, block_hashes: Sequence[int | str] | None = None,
        num_tokens: int | None = None, meta: dict[str, Any] | None = None,
    ) -> Admitted:
        body = {"seq_id": seq_id, **self._prompt(tokens, block_hashes, num_tokens, meta)}
        return Admitted(**self._call("POST", "/v1/sequences", body))

    def commit(self, seq_id: str, num_computed_tokens: int) -> int:
        return self._call("POST", f"/v1/sequences/{seq_id}/commit", {"num_computed_tokens": num_computed_tokens})[
            "published_pages"
        ]

    def append(self, seq_id: str, num_new_tokens: int) -> list[int]:
        return self._call("POST", f"/v1/sequences/{seq_id}/append", {"num_new_tokens": num_new_tokens})["new_page_ids"]

    def fork(self, seq_id: str, new_seq_id: str) -> Forked:
        return Forked(**self._call("POST", f"/v1/sequences/{seq_id}/fork", {"new_seq_id": new_seq_id}))

    def release(self, seq_id: str) -> None:
        self._call("DELETE", f"/v1/sequences/{seq_id}")

    def batch(self, ops: Sequence[dict[str, Any]], report: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Apply ``ops`` in order in one round trip; each result is ``{"ok", "result" | "error"}``."""
        body: dict[str, Any] = {"ops": list(ops)}
        if report is not None:
            body["report"] = report
        return self._call("POST", "/v1/batch", body)["results"]

    def storage_handle(self) -> dict[str, Any]:
        """What an engine needs to map the pool's KV (see :meth:`kvpool_sidecar.storage.KVStorage.attach`)."""
        return self._call("GET", "/v1/storage/handle")

    def lookup(self, tokens: Sequence[int] | None = None, *, block_hashes: Sequence[int | str] | None = None,
               num_tokens: int | None = None, meta: dict[str, Any] | None = None) -> int:
        body = self._prompt(tokens, block_hashes, num_tokens, meta)
        return self._call("POST", "/v1/lookup", body)["num_cached_tokens"]

    def pin(self, tokens: Sequence[int] | None = None, *, block_hashes: Sequence[int | str] | None = None,
            seq_id: str | None = None, meta: dict[str, Any] | None = None, ttl_seconds: float | None = None) -> dict:
        body = self._prompt(tokens, block_hashes, None, meta)
        if seq_id is not None:
            body["seq_id"] = seq_id
        if ttl_seconds is not None:
            body["ttl_seconds"] = ttl_seconds
        return self._call("POST", "/v1/pins", body)

    def unpin(self, pin_id: str) -> None:
        self._call("DELETE", f"/v1/pins/{pin_id}")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/v1/stats")

    def config(self) -> dict[str, Any]:
        return self._call("GET", "/v1/config")

    def put_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return self._call("PUT", "/v1/config", config)

    def metrics(self) -> str:
        return self._http.get("/metrics").text
