"""Prometheus metrics of one sidecar (prometheus-client, its own registry).

Counters and histograms are what PromQL turns into ratios (hit ratio by prompt region and class,
cross-user reuse, eviction efficiency); gauges are read from the pool at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REGIONS = ("prefix", "middle", "suffix")
GAP_BUCKETS = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)
LOOKUP_BUCKETS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 5e-2, 0.25, 1)
EVICTION_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 1e-3, 1e-2)


def region_split(cached: int, length: int) -> list[tuple[str, int, int]]:
    """(region, hit tokens, looked-up tokens) for the thirds of a prompt; hits are always a prefix."""
    edges = [0, length // 3, 2 * length // 3, length]
    out = []
    for i, region in enumerate(REGIONS):
        lo, hi = edges[i], edges[i + 1]
        out.append((region, max(0, min(cached, hi) - lo), hi - lo))
    return out


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self._region_children: dict[str, list[tuple[Any, Any]]] = {}
        self.lookup_tokens = Counter(
            "kvpool_lookup_tokens", "Prompt tokens looked up at admission, by prompt region and class",
            ["workload_class", "region"], registry=r,
        )
        self.hit_tokens = Counter(
            "kvpool_hit_tokens", "Prompt tokens served from cached pages, by prompt region and class",
            ["workload_class", "region"], registry=r,
        )
        self.cross_user_hit_tokens = Counter(
            "kvpool_cross_user_hit_tokens", "Cached tokens hit on pages first computed for another user",
            ["workload_class"], registry=r,
        )
        self.shadow_hit_tokens = Counter(
            "kvpool_shadow_hit_tokens",
            "Tokens an unbounded cache would have served (shadow index of hashes); the ideal for efficiency",
            ["workload_class"], registry=r,
        )
        self.reuse_gap = Histogram(
            "kvpool_reuse_gap_seconds", "Time between a page's release and its reuse (the decay curve)",
            ["workload_class"], buckets=GAP_BUCKETS, registry=r,
        )
        self.evicted_pages = Counter(
            "kvpool_evicted_pages", "Pages evicted, by partition and reason", ["partition", "reason"], registry=r,
        )
        self.eviction_seconds = Histogram(
            "kvpool_eviction_seconds", "Eviction decision time per evicted page on the request path",
            buckets=EVICTION_BUCKETS, registry=r,
        )
        self.reloads = Counter(
            "kvpool_config_reloads", "Config reloads by result (applied, unchanged, invalid)", ["result"],
            registry=r,
        )
        self.pins_removed = Counter(
            "kvpool_pins_removed", "Pins removed by the sidecar itself (quota_lowered: a config lowered "
            "pinning.quotaPercent below the pages pinned; the oldest pins go first)", ["reason"], registry=r,
        )
        self.drift_events = Counter(
            "kvpool_drift_events", "Reuse-rate drift beyond the configured threshold", ["workload_class"],
            registry=r,
        )
        self._define_config(r)
        self._define_engine_and_peers(r)
        self._start_at_zero()

    def _define_config(self, r: CollectorRegistry) -> None:
        self.config_info = Gauge(
            "kvpool_config_info", "The config in force (value 1)", ["hash", "policy", "source"], registry=r,
        )
        self.config_generation = Gauge(
            "kvpool_config_generation", "metadata.generation of the policy in force", registry=r,
        )
        self.config_schema_version = Gauge(
            "kvpool_config_schema_version", "Config schema version of the config in force (of=config) and this "
            "sidecar's own (of=sidecar); they may differ by one (docs/upgrades.md)", ["of"], registry=r,
        )
        self.config_unknown_fields = Gauge(
            "kvpool_config_unknown_fields", "Fields of the config in force, written by an operator one schema "
            "version newer, that this sidecar does not know and ignores (value 1)", ["field"], registry=r,
        )
        self.config_file_missing = Gauge(
            "kvpool_config_file_missing", "1 while the config file (--config) is absent: its policy was deleted "
            "or its ConfigMap is not written yet; the config in force stays (the defaults, for a sidecar that "
            "started without one)", registry=r,
        )

    def _define_engine_and_peers(self, r: CollectorRegistry) -> None:
        self.engine_sessions = Gauge(
            "kvpool_engine_sessions", "Engine sessions connected on the engine channel (scheduler side)",
            registry=r,
        )
        self.lapsed_sequences = Counter(
            "kvpool_engine_lapsed_sequences", "Sequences whose engine session ended (the engine exited or "
            "crashed, or its link failed) while it still held them: quarantined, then released", registry=r,
        )
        self.quarantined_pages = Gauge(
            "kvpool_engine_quarantined_pages", "Pages of lapsed engine sessions held out of circulation until "
            "their engine can no longer copy into or out of them (--engine-quarantine-seconds)", registry=r,
        )
        self._define_peers(r)
        self.connector_tokens = Counter(
            "kvpool_connector_tokens", "Tokens an engine's connector copied (loaded: pool -> engine, saved: "
            "engine -> pool, committed)", ["direction"], registry=r,
        )
        self.connector_lookup_seconds = Histogram(
            "kvpool_connector_lookup_seconds", "Round trip of an engine's lookup as its connector measured it",
            buckets=LOOKUP_BUCKETS, registry=r,
        )
        self.connector_failures = Counter(
            "kvpool_connector_failures", "Connector operations that failed (the engine recomputed or skipped)",
            ["operation"], registry=r,
        )
        self.connector_kv_events = Counter(
            "kvpool_connector_kv_events", "KV events an engine's connector published for kvpool's tier "
            "(stored, removed: one per block)", ["type"], registry=r,
        )

    def _define_peers(self, r: CollectorRegistry) -> None:
        """Peer serving and fetching (:mod:`kvpool_sidecar.peers`)."""
        self.peer_fetches = Counter(
            "kvpool_peer_fetches", "Fetches of a prompt's leading pages from a peer sidecar, by result",
            ["result"], registry=r,
        )
        self.peer_fetch_pages = Counter(
            "kvpool_peer_fetch_pages", "Pages fetched from peers and published here", registry=r,
        )
        self.peer_fetch_bytes = Counter(
            "kvpool_peer_fetch_bytes", "Bytes of KV fetched from peers and published here", registry=r,
        )
        self.peer_fetch_seconds = Histogram(
            "kvpool_peer_fetch_seconds", "A peer fetch from its start to its result (hit, miss or failure)",
            buckets=LOOKUP_BUCKETS, registry=r,
        )
        self.peer_fetch_late = Counter(
            "kvpool_peer_fetch_late", "Engine lookups that stopped waiting for their peer fetch (the engine "
            "computed; the fetch lands for later requests)", registry=r,
        )
        self.peer_served_pages = Counter(
            "kvpool_peer_served_pages", "Pages held for peers to read (offered to their fetches)", registry=r,
        )
        self.peer_members = Gauge(
            "kvpool_peer_members", "Peer sidecars this one may fetch from (--peers: the static list, or the "
            "serving pods of its policy)", registry=r,
        )
        self.peer_membership_errors = Counter(
            "kvpool_peer_membership_errors", "Failed polls of the policy's pods (--peers kubernetes; the last "
            "members were kept)", registry=r,
        )
        self.peer_warmups = Counter(
            "kvpool_peer_warmups", "The policy's named prompts a starting sidecar sought from its peers, by result: "
            "fetched (whole), partial, none (no member held them: left to the engine)", ["result"], registry=r,
        )
        self.peer_refused = Counter(
            "kvpool_peer_refused", "Peer connections and fetches this sidecar refused, by reason", ["reason"],
            registry=r,
        )

    def _start_at_zero(self) -> None:
        """Export every series from the start (at 0) so that rates and alerts see zeros, not absences."""
        for klass in ("toC", "toB"):
            for region in REGIONS:
                self.lookup_tokens.labels(klass, region)
                self.hit_tokens.labels(klass, region)
            self.cross_user_hit_tokens.labels(klass)
            self.shadow_hit_tokens.labels(klass)
            self.reuse_gap.labels(klass)
            self.drift_events.labels(klass)
        for reason in ("capacity", "expired", "pre_eviction", "reclaimed", "unclaimed"):
            for partition in ("toC", "toB"):
                self.evicted_pages.labels(partition, reason)
        for result in ("applied", "unchanged", "invalid"):
            self.reloads.labels(result)
        for direction in ("loaded", "saved"):
            self.connector_tokens.labels(direction)
        for result in ("hit", "partial", "miss", "timeout", "refused", "error", "not_member"):
            self.peer_fetches.labels(result)
        for result in ("fetched", "partial", "none"):
            self.peer_warmups.labels(result)
        for reason in ("unauthorized", "protocol", "timeout", "too_many", "busy"):
            self.peer_refused.labels(reason)
        for operation in ("lookup", "load", "save", "save_skipped"):
            self.connector_failures.labels(operation)
        for kind in ("stored", "removed"):
            self.connector_kv_events.labels(kind)

    def observe_engine_report(self, loaded: int, saved: int, lookups: list[float], failures: dict[str, int],
                              events: dict[str, int] | None = None) -> None:
        self.connector_tokens.labels("loaded").inc(loaded)
        self.connector_tokens.labels("saved").inc(saved)
        for seconds in lookups:
            self.connector_lookup_seconds.observe(seconds)
        for operation, n in failures.items():
            self.connector_failures.labels(operation).inc(n)
        for kind, n in (events or {}).items():
            self.connector_kv_events.labels(kind).inc(n)

    def observe_admission(self, workload_class: str, cached: int, length: int, cross_user: int) -> None:
        children = self._region_children.get(workload_class)
        if children is None:  # labels() costs a lock and a lookup: once per class, not per admission
            children = self._region_children[workload_class] = [
                (self.lookup_tokens.labels(workload_class, r), self.hit_tokens.labels(workload_class, r))
                for r in REGIONS]
        for (looked_c, hit_c), (_, hit, looked) in zip(children, region_split(cached, length), strict=True):
            looked_c.inc(looked)
            if hit:
                hit_c.inc(hit)
        if cross_user:
            self.cross_user_hit_tokens.labels(workload_class).inc(cross_user)

    def add_gauges(self, read: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_PoolCollector(read))


class _PoolCollector(Collector):
    """Pages by state and partition, pins, fragmentation and the fitted decay, read at scrape time."""

    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._read()
        pages = GaugeMetricFamily("kvpool_pages", "Pages by state", labels=["state"])
        for state in ("free", "in_use", "cached", "pinned"):
            pages.add_metric([state], snap["pages"][state])
        yield pages
        part = GaugeMetricFamily(
            "kvpool_partition_pages", "Pages per partition: capacity (its share), owned (in use or cached), evictable, "
            "borrowed (owned past its share: the other partition's idle pages, given back on demand)",
            labels=["partition", "kind"])
        for name, values in snap["partitions"].items():
            for kind, value in values.items():
                part.add_metric([name, kind], value)
        yield part
        yield GaugeMetricFamily("kvpool_pin_quota_pages", "Most pages that may be pinned", value=snap["pin_quota"])
        prompts = GaugeMetricFamily(
            "kvpool_named_prompt_pages", "The policy's named prompts (pinning.prompts): their full pages (kind "
            "total) and the pages pinned of them (pinned; below total until an engine has saved all of it)",
            labels=["prompt", "kind"])
        for name, (pinned, total) in snap["prompts"].items():
            prompts.add_metric([name, "pinned"], pinned)
            prompts.add_metric([name, "total"], total)
        yield prompts
        autopins = CounterMetricFamily(
            "kvpool_autopins", "Auto-pins (long prompts, hot prefixes) by result: pinned; displaced (the oldest "
            "auto-pin lapsed to make room for a newer pin); refused (no room even so)", labels=["result"])
        for result, n in snap["autopins"].items():
            autopins.add_metric([result], n)
        yield autopins
        yield GaugeMetricFamily(
            "kvpool_fragmentation_tokens", "Token slots allocated to live sequences but unused",
            value=snap["fragmentation"],
        )
        yield GaugeMetricFamily(
            "kvpool_unwritten_pages", "Pages live sequences hold for bytes not yet committed (an engine's saves "
            "in flight)", value=snap["unwritten"],
        )
        yield CounterMetricFamily(
            "kvpool_evidence_refused_pages", "Pages an engine's saves did not take because their class is shown not "
            "to come back and the page they would evict holds a claim (eviction.admitByEvidence)",
            value=snap["evidence_refused"])
        yield GaugeMetricFamily("kvpool_sequences", "Live sequences", value=snap["sequences"])
        yield CounterMetricFamily(
            "kvpool_observer_errors", "Failures of the pool's observers (reuse model, sketch, self-tuner): the "
            "call they observed succeeded and the pool stayed exact; each is logged", value=snap["observer_errors"])
        decay = GaugeMetricFamily(
            "kvpool_reuse_decay_per_minute", "Fitted reuse decay rate per workload class", labels=["workload_class"]
        )
        prob = GaugeMetricFamily(
            "kvpool_reuse_probability", "Fitted probability that a released page is reused", labels=["workload_class"]
        )
        for klass, (rate, p) in snap["fits"].items():
            decay.add_metric([klass], rate)
            prob.add_metric([klass], p)
        yield decay
        yield prob
        yield from _tuning_families(snap["tuning"])


def _tuning_families(tuning: dict[str, dict]) -> Iterator[Metric]:
    """The self-tuner per partition: the reuse weight in force, each candidate's shadow hit ratio, switches,
    and the count's lift (the shared partition's)."""
    weight = GaugeMetricFamily(
        "kvpool_tuning_reuse_weight", "Reuse weight (alpha) in force, chosen by the self-tuner or configured",
        labels=["partition"],
    )
    shadows = GaugeMetricFamily(
        "kvpool_tuning_shadow_hit_ratio", "Recent share of sampled pages each candidate's shadow cache hit",
        labels=["partition", "reuse_weight"],
    )
    switches = CounterMetricFamily(
        "kvpool_tuning_switches", "Times the self-tuner moved the live policy to another reuse weight",
        labels=["partition"],
    )
    lift = GaugeMetricFamily(
        "kvpool_tuning_count_lift",
        "How far the count predicts reuse (0: not at all, the credit of counts 2-8 off; 1: fully)",
        labels=["partition"],
    )
    for partition, state in tuning.items():
        weight.add_metric([partition], state["reuse_weight"])
        if state["count_lift"] is not None:
            lift.add_metric([partition], state["count_lift"])
        switches.add_metric([partition], state["switches"])
        for candidate, ratio in state["shadow_hit_ratios"].items():
            shadows.add_metric([partition, f"{candidate:g}"], ratio)
    yield weight
    yield shadows
    yield switches
    yield lift
