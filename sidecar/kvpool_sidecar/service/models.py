"""Wire models (snake_case JSON) of the sidecar API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SeqId = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:\-]+$")]
TokenId = Annotated[int, Field(ge=0, lt=2**63)]
BlockHash = int | Annotated[str, Field(min_length=1, max_length=128)]


class _Wire(BaseModel):
    # Strict: "5" is not a token count. The schema says what is accepted, exactly.
    model_config = ConfigDict(extra="forbid", strict=True)


class Meta(_Wire):
    workload_class: Annotated[str, Field(pattern=r"^(toC|toB)$")] = "toC"
    request_type: Annotated[str, Field(min_length=1, max_length=64)] = "text"
    turn: Annotated[int, Field(ge=0, le=100_000)] = 0
    tenant: Annotated[str, Field(min_length=1, max_length=256)] = "default"
    user: Annotated[str, Field(max_length=256)] = ""


_ONE_PROMPT = {"oneOf": [{"required": ["tokens"]}, {"required": ["block_hashes"]}]}


class Prompt(_Wire):
    """Exactly one of ``tokens`` or ``block_hashes`` (precomputed ids, one per page)."""

    model_config = ConfigDict(json_schema_extra=_ONE_PROMPT)

    # Absent means None; an explicit null is not accepted (the schema says list), hence no Optional.
    tokens: list[TokenId] = Field(default=None, min_length=1, max_length=2_000_000)  # type: ignore[assignment]
    block_hashes: list[BlockHash] = Field(default=None, min_length=1, max_length=200_000)  # type: ignore[assignment]
    num_tokens: Annotated[int, Field(ge=1)] = None  # type: ignore[assignment]
    meta: Meta = Field(default_factory=Meta)

    @model_validator(mode="after")
    def _one_of(self) -> Prompt:
        if (self.tokens is None) == (self.block_hashes is None):
            raise ValueError("give exactly one of tokens or block_hashes")
        return self


class AdmitRequest(Prompt):
    seq_id: SeqId


class AdmitResponse(_Wire):
    seq_id: str
    num_cached_tokens: int
    page_ids: list[int]
    storage_epoch: int | None = Field(
        default=None, description="epoch of the KV storage these page ids index (null: bookkeeping only); "
        "an engine copies KV only into a mapping of this epoch")


class CommitRequest(_Wire):
    num_computed_tokens: Annotated[int, Field(ge=0)]


class CommitResponse(_Wire):
    seq_id: str
    published_pages: int


class AppendRequest(_Wire):
    num_new_tokens: Annotated[int, Field(ge=0, le=10_000_000)]


class AppendResponse(_Wire):
    seq_id: str
    new_page_ids: list[int]


class ForkRequest(_Wire):
    new_seq_id: SeqId


class ForkResponse(_Wire):
    seq_id: str
    page_ids: list[int]
    copy_src: int = Field(description="page whose KV storage copies into copy_dst; -1: nothing to copy")
    copy_dst: int


class LookupResponse(_Wire):
    num_cached_tokens: int


class PinRequest(_Wire):
    """Pin a cached prefix (``tokens`` or ``block_hashes``) or the published pages of ``seq_id``."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": [k]} for k in ("tokens", "block_hashes", "seq_id")]}
    )

    tokens: list[TokenId] = Field(default=None, min_length=1)  # type: ignore[assignment]
    block_hashes: list[BlockHash] = Field(default=None, min_length=1)  # type: ignore[assignment]
    seq_id: SeqId = None  # type: ignore[assignment]
    # With tokens: the engine model whose pages to pin (its --model, a hub name or path, or its full identity):
    # the tokens are hashed as that engine hashes its blocks, so the pin holds what the engine looks up.
    model: str = Field(default=None, min_length=1, max_length=4096)  # type: ignore[assignment]
    meta: Meta = Field(default_factory=Meta)
    ttl_seconds: Annotated[float, Field(gt=0, le=30 * 86400)] = None  # type: ignore[assignment]

    @model_validator(mode="after")
    def _one_of(self) -> PinRequest:
        given = sum(x is not None for x in (self.tokens, self.block_hashes, self.seq_id))
        if given != 1:
            raise ValueError("give exactly one of tokens, block_hashes or seq_id")
        if self.model is not None and self.tokens is None:
            raise ValueError("model names the engine whose key space the tokens are hashed in: give tokens with it")
        return self


class PinResponse(_Wire):
    pin_id: str
    pages: list[int]
    expires_at: float | None


class PinInfo(_Wire):
    pin_id: str
    pages: int
    expires_at: float | None
    auto: bool  # the pool's own (a long prompt or a hot prefix); an admin may unpin it


class PinList(_Wire):
    pins: list[PinInfo]


class ErrorResponse(_Wire):
    error: str
    detail: str
    field: str = ""


class ConfigView(_Wire):
    config: dict[str, Any]
    hash: str
    generation: int
    source: dict[str, Any] | None
    last_error: str | None
    notice: str | None = Field(default=None, description="what the config in force did beyond its values, "
                               "e.g. the oldest pins it removed to fit a lowered pin quota")
    file_missing: bool = Field(default=False, description="the --config file is absent (its policy deleted, or "
                               "its ConfigMap not written yet): the config in force stays")
    reloads: dict[str, int]
    to_b_share_percent: float = Field(description="to-B's share of pages in force now (workloads.toB.schedule's "
                                      "window at this hour, else isolationPercent)")
    prompts: list[NamedPromptView] = Field(description="the policy's named prompts and how much of each is pinned")


class NamedPromptView(_Wire):
    name: str
    model: str
    pages: int = Field(description="its full pages")
    pinned: int = Field(description="pages pinned of them")
    problem: str | None = Field(description="why it is not wholly pinned (not saved by an engine yet, over the "
                                "pin quota, no engine of its model connected)")


class BatchAdmit(AdmitRequest):
    op: Literal["admit"]


class BatchCommit(CommitRequest):
    op: Literal["commit"]
    seq_id: SeqId


class BatchAppend(AppendRequest):
    op: Literal["append"]
    seq_id: SeqId


class BatchRelease(_Wire):
    op: Literal["release"]
    seq_id: SeqId


BatchOp = Annotated[BatchAdmit | BatchCommit | BatchAppend | BatchRelease, Field(discriminator="op")]


class EngineReport(_Wire):
    """What an engine's connector measured since its last report (exported as kvpool_connector_*)."""

    loaded_tokens: Annotated[int, Field(ge=0, le=2**40)] = 0
    saved_tokens: Annotated[int, Field(ge=0, le=2**40)] = 0
    lookup_seconds: list[Annotated[float, Field(ge=0, le=3600)]] = Field(default_factory=list, max_length=4096)
    failures: dict[Literal["lookup", "load", "save", "save_skipped"], Annotated[int, Field(ge=0, le=2**40)]] = Field(
        default_factory=dict)
    events: dict[Literal["stored", "removed"], Annotated[int, Field(ge=0, le=2**40)]] = Field(
        default_factory=dict)


class BatchRequest(_Wire):
    """Operations applied in order, each on its own (one failing changes nothing and stops nothing):
    what an engine sends once per scheduling step, saving an HTTP round trip per sequence. ``report``
    carries the connector's own measurements along (no extra round trip)."""

    ops: list[BatchOp] = Field(max_length=4096)
    report: EngineReport | None = None

    @model_validator(mode="after")
    def _something(self) -> BatchRequest:
        if not self.ops and self.report is None:
            raise ValueError("give at least one op, or a report")
        return self


class BatchResult(_Wire):
    ok: bool
    result: dict[str, Any] | None = None
    error: ErrorResponse | None = None


class BatchResponse(_Wire):
    results: list[BatchResult]
