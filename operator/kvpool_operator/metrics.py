"""The operator's own Prometheus metrics: handler runs, their errors and latency, and each policy's pods.

kopf exports no metrics; the handlers count here (:func:`handling`) and ``kvpool-operator run
--metrics-port`` serves :data:`REGISTRY`. The module is imported once per process (tests re-import the
handlers, never this), so the series live as long as the process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes.client.rest import ApiException
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()
HANDLERS = ("create", "update", "resume", "resync")
ERROR_REASONS = ("invalid_spec", "api_error", "exception")

RECONCILES = Counter(
    "kvpool_operator_reconciles", "Handler runs on KVCachePolicies (create, update, resume, resync)",
    ["handler"], registry=REGISTRY,
)
ERRORS = Counter(
    "kvpool_operator_reconcile_errors", "Handler runs that failed: invalid_spec (the policy was refused), "
    "api_error (a Kubernetes API call failed; kopf retries), exception", ["handler", "reason"], registry=REGISTRY,
)
SECONDS = Histogram(
    "kvpool_operator_reconcile_seconds", "Time a handler run took (pods listed, sidecars read, ConfigMap written)",
    ["handler"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=REGISTRY,
)
TARGET_PODS = Gauge(
    "kvpool_operator_policy_target_pods", "Running pods labelled kvpool.dev/policy=<policy> whose sidecar mounts "
    "its ConfigMap (status.targetPods)",
    ["policy_namespace", "policy"], registry=REGISTRY,
)
SYNCED_PODS = Gauge(
    "kvpool_operator_policy_synced_pods", "Of those, pods whose sidecar reports the policy's config hash "
    "(status.syncedPods)", ["policy_namespace", "policy"], registry=REGISTRY,
)
MISBOUND_PODS = Gauge(
    "kvpool_operator_policy_misbound_pods", "Live pods labelled kvpool.dev/policy=<policy> whose sidecar does not "
    "mount its ConfigMap (status.misboundPods)", ["policy_namespace", "policy"], registry=REGISTRY,
)
for _handler in HANDLERS:  # every series at 0 from the start: rate() and increase() see the first one
    RECONCILES.labels(_handler)
    SECONDS.labels(_handler)
    for _reason in ERROR_REASONS:
        ERRORS.labels(_handler, _reason)


@contextmanager
def handling(handler: str) -> Iterator[None]:
    """Count one handler run, time it, and count the exception it ends with (then raise it on)."""
    RECONCILES.labels(handler).inc()
    start = time.perf_counter()
    try:
        yield
    except ApiException:
        ERRORS.labels(handler, "api_error").inc()
        raise
    except Exception:
        ERRORS.labels(handler, "exception").inc()
        raise
    finally:
        SECONDS.labels(handler).observe(time.perf_counter() - start)


def invalid_spec(handler: str) -> None:
    """The run refused the policy's spec (Valid=False; the last valid config stays in force)."""
    ERRORS.labels(handler, "invalid_spec").inc()


def publish(namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
    """Export a policy's pod counts from the status about to be written; returns the status."""
    TARGET_PODS.labels(namespace, name).set(int(status.get("targetPods") or 0))
    SYNCED_PODS.labels(namespace, name).set(int(status.get("syncedPods") or 0))
    if "misboundPods" in status:  # absent: not looked at this time (an invalid spec), the last count stands
        MISBOUND_PODS.labels(namespace, name).set(int(status["misboundPods"]))
    return status


def forget(namespace: str, name: str) -> None:
    """A deleted policy's series go with it."""
    for gauge in (TARGET_PODS, SYNCED_PODS, MISBOUND_PODS):
        try:
            gauge.remove(namespace, name)
        except KeyError:
            pass
