"""The config in force and its reloads: from the file (file events or polling) or a PUT, applied only
when it parses, validates and matches its ``source.hash``; the config in force stays otherwise. A file
of the next schema version (a newer operator's) is applied without the fields this sidecar does not
know: they are logged, named in ``notice`` and in ``kvpool_config_unknown_fields``. A file that goes away
(its policy deleted: the pod's optional ConfigMap volume empties) leaves the config in force as it is,
logged once and shown by ``kvpool_config_file_missing``; a sidecar started without its file runs on the
defaults until the file appears."""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

from kvpool_sidecar.config import SCHEMA_VERSION, ConfigError, SidecarConfig, parse_config_text, spec_hash
from kvpool_sidecar.policies import PolicyError
from kvpool_sidecar.pool import InvalidRequest
from kvpool_sidecar.service.prompts import check_prompts_fit

log = logging.getLogger("kvpool.sidecar")


@dataclass
class ConfigState:
    config: SidecarConfig
    hash: str
    last_error: str | None = None
    reloads: dict[str, int] = field(default_factory=lambda: {"applied": 0, "unchanged": 0, "invalid": 0})
    file_digest: str = ""
    pending_digest: str = ""
    notice: str | None = None  # what the last applied config did beyond its values (pins it removed)
    file_missing: bool = False  # the config file is absent (its policy deleted): the config in force stays


class ConfigReloads:
    """The config half of :class:`~kvpool_sidecar.service.state.Sidecar`."""

    def config_view(self) -> dict[str, Any]:
        cfg = self.state.config
        return {
            "config": cfg.spec().model_dump(mode="json"),
            "hash": self.state.hash,
            "generation": cfg.source.generation if cfg.source else 0,
            "source": cfg.source.model_dump() if cfg.source else None,
            "last_error": self.state.last_error,
            "notice": self.state.notice,
            "file_missing": self.state.file_missing,
            "reloads": dict(self.state.reloads),
            "to_b_share_percent": self.pool.spec.workloads.toB.isolationPercent,  # the schedule's, in force now
            "prompts": [state.view() for state in self.prompts.states.values()],
        }

    def apply_config_text(self, text: str, origin: str) -> tuple[str, str | None, str]:
        """Validate and apply a config; returns (result, error, field at fault). The old config stays on
        any error."""
        if not text.strip() and self.state.file_digest:
            # An empty file where a config was is a write in progress or a mistake, not "all defaults".
            return self.reject(f"{origin}: the file is empty; the config in force stays (write {{}} for defaults)")
        try:
            config = parse_config_text(text)
        except ConfigError as exc:
            return self.reject(f"{origin}: {exc}", exc.field)
        return self.apply_config(config, origin)

    def apply_config(self, config: SidecarConfig, origin: str) -> tuple[str, str | None, str]:
        new_hash = spec_hash(config)
        if config.source is not None and config.source.hash and config.source.hash != new_hash:
            # The operator writes the spec's hash into the file: a file cut short (even at a line
            # boundary, where it still parses) or edited by hand no longer matches it.
            return self.reject(
                f"{origin}: the content's hash {new_hash} is not its source.hash {config.source.hash} "
                "(a partly written or hand-edited file); the config in force stays", "source.hash",
            )
        same_source = config.source == self.state.config.source
        if new_hash == self.state.hash and same_source:
            self._count("unchanged")
            return "unchanged", None, ""
        try:
            check_prompts_fit(config.spec(), self.pool.total_pages)
            unpinned = self.pool.reconfigure(config.spec().at(self.minute_of_day()))
        except (InvalidRequest, PolicyError) as exc:
            return self.reject(f"{origin}: {exc}", getattr(exc, "field", ""))
        self.prompts.configure(config.spec(), self.unpin_own)
        self.state.notice = self._report_unpinned(unpinned, config) if unpinned else None
        self.state.config = config
        self.state.hash = new_hash
        self.state.last_error = None
        self._count("applied")
        self._set_config_metrics()
        log.info("config applied from %s: hash %s, policy %s", origin, new_hash, config.eviction.policy)
        if config.removed_fields:
            log.info("config schema version %s is older than this sidecar's %s: ignored the fields removed since "
                     "(%s)", config.schema_version, SCHEMA_VERSION, ", ".join(config.removed_fields))
        return "applied", None, ""

    def _report_unpinned(self, unpinned: list[Any], config: SidecarConfig) -> str:
        for record in unpinned:
            self._forget_pin(record.pin_id)
        self.metrics.pins_removed.labels("quota_lowered").inc(len(unpinned))
        notice = (f"pinning.quotaPercent {config.pinning.quotaPercent} leaves room for {self.pool.pinning.quota} "
                  f"pinned pages: unpinned the {len(unpinned)} oldest pins "
                  f"({', '.join(r.pin_id for r in unpinned[:8])}{', ...' if len(unpinned) > 8 else ''})")
        log.warning("%s", notice)
        return notice

    def minute_of_day(self) -> int:
        """The minute of the day (UTC) the to-B schedule is read at."""
        now = self.wall()
        return now.hour * 60 + now.minute

    def follow_schedule(self) -> bool:
        """Put the to-B share the schedule sets now in force (pages move as the partitions evict);
        returns whether it changed."""
        spec = self.state.config.spec().at(self.minute_of_day())
        if spec.workloads.toB.isolationPercent == self.pool.spec.workloads.toB.isolationPercent:
            return False
        log.info("to-B share: %g %% of pages by workloads.toB.schedule (was %g %%)",
                 spec.workloads.toB.isolationPercent, self.pool.spec.workloads.toB.isolationPercent)
        self.pool.reconfigure(spec)
        return True

    def reject(self, message: str, field: str = "") -> tuple[str, str | None, str]:
        """Record a config that was not applied; the one in force stays."""
        self.state.last_error = message
        self._count("invalid")
        log.error("config rejected, keeping hash %s: %s", self.state.hash, message)
        return "invalid", message, field

    def _count(self, result: str) -> None:
        self.state.reloads[result] = self.state.reloads.get(result, 0) + 1
        self.metrics.reloads.labels(result).inc()

    def _set_config_metrics(self) -> None:
        cfg = self.state.config
        self.metrics.config_info.clear()
        source = f"{cfg.source.namespace}/{cfg.source.name}" if cfg.source else "local"
        self.metrics.config_info.labels(self.state.hash, cfg.eviction.policy, source).set(1)
        self.metrics.config_generation.set(cfg.source.generation if cfg.source else 0)
        self.metrics.config_schema_version.labels("config").set(cfg.schema_version)
        self.metrics.config_schema_version.labels("sidecar").set(SCHEMA_VERSION)
        self.metrics.config_unknown_fields.clear()
        for name in cfg.unknown_fields:
            self.metrics.config_unknown_fields.labels(name).set(1)
        if cfg.unknown_fields:
            ignored = (f"config schema version {cfg.schema_version} is newer than this sidecar's {SCHEMA_VERSION}: "
                       f"ignored the fields it does not know ({', '.join(cfg.unknown_fields)}); upgrade the "
                       "sidecar to use them (docs/upgrades.md)")
            log.warning("%s", ignored)
            self.state.notice = f"{self.state.notice}; {ignored}" if self.state.notice else ignored

    def mark_config_file_read(self, digest: str | None) -> None:
        """The sidecar started on the file whose bytes hash to ``digest``: those are not 'reloaded', and a
        file that differs (written since it was read) is applied at the next poll. None: it started on the
        defaults, the file absent (no policy's ConfigMap in the optional volume); it is applied once it
        appears, even if that was a moment ago."""
        if self.config_path is None:
            return
        if digest is not None:
            self.state.file_digest = digest
        elif not self.config_path.exists():
            self._file_gone()

    def _file_gone(self) -> None:
        """The config file is absent: keep the config in force, say so once."""
        if not self.state.file_missing:
            log.warning("config file %s is absent (its policy deleted, or its ConfigMap not written yet): keeping "
                        "config hash %s%s", self.config_path, self.state.hash,
                        "" if self.state.config.source else " (the defaults)")
        self.state.file_missing = True
        self.metrics.config_file_missing.set(1)

    def poll_config_file(self, settled: bool = False) -> str | None:
        """Re-read the config file; apply it when its content changed. Kubelet swaps a ``..data``
        symlink instead of rewriting the file, so the content, not the inode or mtime, is compared.
        ``settled``: a file event saw the writes pause, so one read is enough."""
        if self.config_path is None:
            return None
        try:
            data = self.config_path.read_bytes()
        except FileNotFoundError:
            self._file_gone()
            self.state.pending_digest = ""
            return None
        except OSError as exc:
            message = f"{self.config_path}: cannot read: {exc.strerror}"
            if self.state.last_error != message:
                self.reject(message)
            return "invalid"
        if self.state.file_missing:
            log.info("config file %s is back", self.config_path)
            self.state.file_missing = False
            self.metrics.config_file_missing.set(0)
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.state.file_digest:
            self.state.pending_digest = ""
            return None
        if digest != self.state.pending_digest and not settled:
            # A plain rewrite is not atomic: act on content only once two polls in a row read it
            # (kubelet's symlink swap is atomic, an editor's or a script's write may not be).
            self.state.pending_digest = digest
            return None
        self.state.file_digest = digest
        self.state.pending_digest = ""
        return self.apply_config_text(data.decode("utf-8", errors="replace"), str(self.config_path))[0]
