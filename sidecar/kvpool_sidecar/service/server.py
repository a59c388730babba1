"""``kvpool-sidecar serve``: build the sidecar from flags and run it under uvicorn."""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import socket
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from prometheus_client import start_http_server

from kvpool_sidecar.config import SidecarConfig, parse_config_text
from kvpool_sidecar.errors import InvalidRequest
from kvpool_sidecar.peers.keys import TransferKeys
from kvpool_sidecar.peers.node import REFRESH_SECONDS, Peers, parse_peers
from kvpool_sidecar.service.app import DEFAULT_MAX_BODY_BYTES, create_app
from kvpool_sidecar.service.channel import DEFAULT_QUARANTINE, socket_in_use
from kvpool_sidecar.service.credentials import Credentials
from kvpool_sidecar.service.membership import KUBERNETES, PolicyPeers, default_namespace, load_kube_config
from kvpool_sidecar.service.prompts import check_prompts_fit
from kvpool_sidecar.service.state import (
    DEFAULT_MAX_PINS_PER_OWNER,
    DEFAULT_MAX_SEQUENCE_TOKENS,
    DEFAULT_MAX_SEQUENCES,
    Sidecar,
)
from kvpool_sidecar.service.warmup import WARMUP_SECONDS
from kvpool_sidecar.storage import KVStorage, ModelShape
from kvpool_sidecar.storage.tensors import WritersStillActive

DEFAULT_PAGES = 65_536
DEFAULT_ENGINE_SOCKET = "/tmp/kvpool/engine.sock"  # the connector's default too; pods mount a shared emptyDir


class ServeError(ValueError):
    """A flag combination the sidecar refuses to start with."""


@dataclass(frozen=True)
class ServeOptions:
    config: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    pages: int = DEFAULT_PAGES
    token_file: str | None = None
    metrics_host: str | None = None
    metrics_port: int | None = None
    log_level: str = "info"
    kv_shape: str | None = None  # "layers,kv_heads,head_dim[,dtype]": allocate the KV tensors too
    transfer_key_file: str | None = None  # the cluster keys peers prove to each other
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_sequences: int = DEFAULT_MAX_SEQUENCES
    max_sequence_tokens: int = DEFAULT_MAX_SEQUENCE_TOKENS
    max_pins_per_owner: int = DEFAULT_MAX_PINS_PER_OWNER
    engine_socket: str | None = DEFAULT_ENGINE_SOCKET  # the engine channel (None: off)
    engine_quarantine: float = DEFAULT_QUARANTINE  # seconds a lapsed engine session's pages stay out of use
    peer_port: int | None = None  # serve the pool to peer sidecars (None: off)
    peer_host: str = "0.0.0.0"
    peers: str | None = None  # HOST:PORT,... the peer sidecars this one fetches from, or "kubernetes"
    peer_namespace: str | None = None  # --peers kubernetes: for a config whose source names no namespace
    peer_refresh: float = REFRESH_SECONDS  # --peers kubernetes: seconds between two polls of the policy's pods
    peer_warmup: float = WARMUP_SECONDS  # the start-up fetch of the named prompts from peers, at most (0: none)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(options: ServeOptions) -> str | None:
    """The bearer token: required when the control API is reachable from outside the pod."""
    if options.token_file is None:
        if not is_loopback(options.host):
            raise ServeError(
                f"--host {options.host} exposes the control API beyond localhost: give --token-file "
                "(a mounted Secret) or bind 127.0.0.1"
            )
        return None
    try:
        token = Path(options.token_file).read_text().strip()
    except OSError as exc:
        raise ServeError(f"--token-file {options.token_file}: {exc.strerror}") from None
    if len(token) < 16:
        raise ServeError(f"--token-file {options.token_file}: the token must be at least 16 characters")
    return token


def read_credentials(options: ServeOptions) -> Credentials | None:
    """The API's credentials (``--token-file``: one token, or lines ``ROLE TOKEN``); required beyond loopback."""
    if options.token_file is None:
        read_token(options)  # refuses a wider bind without one
        return None
    try:
        text = Path(options.token_file).read_text()
    except OSError as exc:
        raise ServeError(f"--token-file {options.token_file}: {exc.strerror}") from None
    try:
        return Credentials.parse(text, f"--token-file {options.token_file}")
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def parse_shape(text: str) -> ModelShape:
    parts = text.split(",")
    if len(parts) not in (3, 4):
        raise ServeError("--kv-shape must be layers,kv_heads,head_dim[,dtype], e.g. 32,8,128,bfloat16")
    try:
        return ModelShape(int(parts[0]), int(parts[1]), int(parts[2]), *parts[3:])
    except ValueError as exc:
        raise ServeError(f"--kv-shape: {exc}") from None


def initial_config(path: str | None) -> tuple[SidecarConfig, str | None]:
    """The config a sidecar starts on, and the digest of the file's bytes it was parsed from: its
    ``--config`` file, or the defaults (no digest) where that file is absent from a directory that is there
    (a pod whose policy is deleted, or not yet rendered: its optional ConfigMap volume is empty). The file,
    once it appears, is applied like any reload. A directory that is not there is a mistyped path: refused.
    The bytes are read once, so the digest is of what was applied, whatever the file holds a moment later."""
    if not path:
        return SidecarConfig(), None
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        if not Path(path).absolute().parent.is_dir():
            raise ServeError(f"--config {path}: neither the file nor its directory exists") from None
        return SidecarConfig(), None  # reloads.mark_config_file_read logs it and sets kvpool_config_file_missing
    return parse_config_text(data.decode()), hashlib.sha256(data).hexdigest()


def build(options: ServeOptions) -> tuple[Sidecar, Credentials | None]:
    if options.pages < 1:
        raise ServeError("--pages must be at least 1")
    if options.engine_socket and socket_in_use(Path(options.engine_socket)):
        raise ServeError(f"--engine-socket {options.engine_socket}: another process serves it (a second sidecar "
                         "on this host needs its own path)")
    token = read_credentials(options)
    config, digest = initial_config(options.config)
    try:
        check_prompts_fit(config.spec(), options.pages)
    except InvalidRequest as exc:
        raise ServeError(f"--config {options.config}: {exc}") from None
    keys = None
    if options.transfer_key_file:
        try:
            keys = TransferKeys.load(options.transfer_key_file)
        except ValueError as exc:
            raise ServeError(f"--transfer-key-file: {exc}") from None
    storage = None
    if options.kv_shape:
        # Named for this instance (host and port: one per sidecar in a pod), so that a restart finds and
        # takes over the segment a killed predecessor left behind.
        try:
            storage = KVStorage(parse_shape(options.kv_shape), config.pageSize, pages=options.pages, shared=True,
                                instance=instance_name(options.port))
        except WritersStillActive as exc:
            raise ServeError(str(exc)) from None
    sidecar = Sidecar(config, options.pages, config_path=options.config, storage=storage, transfer_keys=keys,
                      max_sequences=options.max_sequences, max_sequence_tokens=options.max_sequence_tokens,
                      max_pins_per_owner=options.max_pins_per_owner)
    sidecar.mark_config_file_read(digest)
    return sidecar, token


def build_peers(options: ServeOptions, sidecar: Sidecar) -> Peers | None:
    """The peer server (``--peer-port``) and client (``--peers``: a static list, or ``kubernetes``: the pods of
    the config's policy), or None when neither is asked for."""
    if options.peer_port is None and not options.peers:
        return None
    flag = "--peer-port" if options.peer_port is not None else "--peers"
    if sidecar.transfer_keys is None:
        raise ServeError(f"{flag}: peers prove the cluster key to each other: give --transfer-key-file")
    if sidecar.storage is None:
        raise ServeError(f"{flag}: peers read and serve the pool's KV: give --kv-shape")
    membership = None
    if options.peers == KUBERNETES:
        if options.peer_port is None:
            raise ServeError(f"--peers {KUBERNETES}: the members serve on this sidecar's --peer-port (the same on "
                             "every pod of a policy): give --peer-port")
        try:
            load_kube_config()
        except Exception as exc:  # no in-cluster service account and no kubeconfig
            raise ServeError(f"--peers {KUBERNETES}: no Kubernetes credentials: {exc}") from None
        membership = PolicyPeers(lambda: sidecar.state.config.source, options.peer_port,
                                 options.peer_namespace or default_namespace()).members
    try:
        members = parse_peers(options.peers or "") if membership is None else frozenset()
        return Peers(sidecar, sidecar.transfer_keys, port=options.peer_port, bind=options.peer_host, members=members,
                     membership=membership, refresh_seconds=options.peer_refresh)
    except (ValueError, RuntimeError) as exc:
        raise ServeError(str(exc)) from None


def instance_name(port: int) -> str:
    """The name of the sidecar serving ``port`` on this host (one per sidecar in a pod): its pool's segment
    is named for it, so that every run of the instance finds and takes over what the last one left."""
    return f"{socket.gethostname()}-{port}".replace("/", "-")


def serve(options: ServeOptions) -> None:
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("watchfiles").setLevel(logging.WARNING)  # the sidecar logs the reloads it applies
    sidecar, token = build(options)
    try:
        peers = build_peers(options, sidecar)
    except ServeError:
        sidecar.close()
        raise
    separate_metrics = options.metrics_port is not None
    if separate_metrics:
        # Metrics are read-only and open by design, but only where asked: loopback unless --metrics-host.
        start_http_server(options.metrics_port, options.metrics_host or "127.0.0.1", registry=sidecar.metrics.registry)
    app = create_app(sidecar, token=token, serve_metrics=not separate_metrics, on_shutdown=sidecar.close,
                     max_body_bytes=options.max_body_bytes, engine_socket=options.engine_socket,
                     engine_quarantine=options.engine_quarantine, peers=peers, peer_warmup=options.peer_warmup)
    try:
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level, access_log=False)
    finally:
        sidecar.close()
