"""A request's peer hint: where the sidecar may fetch the prompt's missing leading pages from (issue 66).

The shape vLLM's own p2p tier reads and llm-d's routing sidecar writes (from the header its router's P2P source
producer sets: docs/routing.md), in the request's ``kv_transfer_params``::

    {"remote_kv_source": {"remote_host": "10.0.0.7", "remote_port": 8300}}

``remote_port`` being the source sidecar's peer port (``--peer-port``); vLLM's ``kv_request_id`` may be there
too and is not used. It is read whether or not the deployment trusts request params for tenants and classes:
a hint only chooses which member the sidecar reads from (the sidecar ignores, and counts, one naming no
member of its ``--peers``), and a fetch is bounded by the request's own prompt, keyed by its own model and
tenant. A malformed hint is no hint.
"""

from __future__ import annotations

from typing import Any

from kvpool_sidecar import wire

HINT = "remote_kv_source"
MAX_HOST = 253  # characters of a DNS name


def peer_source(params: dict[str, Any] | None) -> wire.Source | None:
    """The hint's (host, peer port), or None when the request has none or a malformed one."""
    hint = params.get(HINT) if isinstance(params, dict) else None
    if not isinstance(hint, dict):
        return None
    host, port = hint.get("remote_host"), hint.get("remote_port")
    if isinstance(port, str) and port.isascii() and port.isdigit() and len(port) <= 5:  # not "²", not 5000 digits
        port = int(port)
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST or isinstance(port, bool) or \
            not isinstance(port, int) or not 0 < port < 65536:
        return None
    return wire.Source(host.strip("[]"), port)
