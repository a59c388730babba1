"""The connector's settings: ``kv_connector_extra_config`` of the engine's ``--kv-transfer-config``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_SOCKET = "/tmp/kvpool/engine.sock"  # the sidecar's --engine-socket default


class ConnectorConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message names the field and the rule."""


class DefaultMeta(BaseModel):
    """Workload metadata for requests whose ``kv_transfer_params`` do not say."""

    model_config = ConfigDict(extra="forbid", strict=True)
    tenant: Annotated[str, Field(min_length=1, max_length=256)] = "default"
    workload_class: Literal["toC", "toB"] = "toC"
    request_type: Annotated[str, Field(min_length=1, max_length=64)] = "text"
    turn: Annotated[int, Field(ge=0, le=100_000)] = 0


class ChannelSettings(BaseModel):
    """How an engine's scheduler reaches its sidecar, and what its requests may say (the connector's and
    the tier's settings share these)."""

    model_config = ConfigDict(extra="forbid")

    socket: Annotated[str, Field(min_length=1, max_length=107, pattern=r"^/")] = DEFAULT_SOCKET
    token: str | None = Field(default=None, min_length=16, description="the sidecar's bearer token")
    token_file: str | None = Field(default=None, description="a file holding it (a mounted Secret)")
    lookup_wait_ms: Annotated[float, Field(ge=0, le=100)] = 2.0
    timeout_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    defaults: DefaultMeta = Field(default_factory=DefaultMeta)
    trust_request_params: bool = Field(
        default=False, description="take tenant, class, turn and user from a request's kv_transfer_params "
        "(a client's OpenAI body): only where a gateway strips and sets them")
    peer_fetch_wait_ms: Annotated[float, Field(ge=0, le=10_000)] = Field(
        default=250.0, description="how long a request with a remote_kv_source hint waits for its sidecar to "
        "fetch the prompt's missing pages from that peer, from its first lookup (only that request waits: the "
        "engine schedules the others meanwhile); then it computes them, and the fetch lands for the next one")

    @model_validator(mode="after")
    def _one_token(self) -> ChannelSettings:
        if self.token is not None and self.token_file is not None:
            raise ValueError("give token or token_file, not both")
        return self

    def bearer(self, where: str = "kv_connector_extra_config") -> str | None:
        if self.token_file is None:
            return self.token
        try:
            token = Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise ConnectorConfigError(f"{where}.token_file {self.token_file}: {exc.strerror}") from None
        if len(token) < 16:
            raise ConnectorConfigError(f"{where}.token_file {self.token_file}: "
                                       "the token must be at least 16 characters")
        return token


class ConnectorSettings(ChannelSettings):
    """``KVPoolConnector``'s ``kv_connector_extra_config``."""

    kernels: Literal["triton", "triton-interpreter", "torch"] | None = None
    max_save_backlog_ms: Annotated[float, Field(ge=0, le=60_000)] = Field(
        default=1000.0, description="back-pressure on the save lane: a step's saves are skipped (counted as "
        "save_skipped, never queued) while the oldest queued save has waited longer than this, so the lane "
        "never falls further behind the engine and a finished request's blocks wait for it about this long "
        "at most")
    kv_events: bool = Field(
        default=False, description="publish kvpool's tier as the engine's KV events (BlockStored and "
        "BlockRemoved with medium CPU), merged into vLLM's own stream (its --kv-events-config)")
    untested_cuda: bool = Field(
        default=False, description="run the connector's own CUDA copy path (never run on a GPU yet: "
        "bench/gpu.py is the check to run first); on a GPU, vLLM's OffloadingConnector with KVPoolTier "
        "is the path to use")


# The keys vLLM itself reads in every secondary_tiers entry (vllm.v1.kv_offload.tiering's factory and
# spec): ``type``, ``module_path`` and ``backpressure`` it takes out before it builds the tier (and
# validates itself); ``locality`` it reads there and passes on, to the tier (TierSettings.locality).
VLLM_TIER_KEYS = ("type", "module_path", "backpressure")


class TierSettings(ChannelSettings):
    """kvpool's entry in ``secondary_tiers`` of vLLM's ``TieringOffloadingSpec`` (besides the keys vLLM
    reads itself: :data:`VLLM_TIER_KEYS`). Its lookups answer at the next scheduler step at the earliest,
    so its budget runs from when the step's lookups were sent."""

    lookup_wait_ms: Annotated[float, Field(ge=0, le=1000)] = 20.0
    locality: Literal["LOCAL", "REMOTE"] | None = Field(
        default=None, description="vLLM's tier locality (its Locality): a request's load_tier_filter "
        "matches it, and the tier's KV events carry it")


def parse_settings(extra: dict[str, Any] | None) -> ConnectorSettings:
    return _parse(ConnectorSettings, extra, "kv_connector_extra_config")


def parse_tier_settings(params: dict[str, Any] | None, where: str) -> TierSettings:
    """A secondary_tiers entry, whole or as vLLM passes it to the tier: vLLM's own keys are vLLM's to
    check; any other key must be one of kvpool's (a typo is refused, naming it)."""
    return _parse(TierSettings, {k: v for k, v in (params or {}).items() if k not in VLLM_TIER_KEYS}, where)


_S = TypeVar("_S", bound=BaseModel)


def _parse(model: type[_S], extra: dict[str, Any] | None, prefix: str) -> _S:
    try:
        return model.model_validate(extra or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join([prefix, *(str(p) for p in first["loc"])])
        raise ConnectorConfigError(f"{where}: {first['msg']}") from None
