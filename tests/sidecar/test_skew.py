"""Version skew (issue 68, docs/upgrades.md): a sidecar one config schema version apart from the operator
reads its file, and reports the hash that operator expects; beyond one version, or with a typo at its own
version, the file is refused naming the field."""

from __future__ import annotations

import logging

import pytest
import yaml
from kvpool_operator.render import config_document
from kvpool_operator.status import config_hash_from_metrics
from kvpool_sidecar.config import ConfigError, KVCachePolicySpec, SidecarConfig, parse_config_text
from kvpool_sidecar.service.state import Sidecar
from prometheus_client import generate_latest

SPEC = {"pageSize": 4, "eviction": {"policy": "lru", "weights": {"reuse": 0.5}},
        "pinning": {"quotaPercent": 10, "autoPin": {"enabled": False}}, "routing": {"minLoad": 8}}


def rendered(spec: dict = SPEC) -> dict:
    """The file this operator renders for ``spec``, as a mapping."""
    text, _ = config_document("chat", "llm", 3, KVCachePolicySpec.model_validate(spec))
    return yaml.safe_load(text)


def as_written(doc: dict) -> tuple[str, str]:
    """``doc`` as an operator of its schema version writes it: the hash (by the one formula) in source.hash."""
    from kvpool_sidecar.config import config_hash

    doc["source"]["hash"] = digest = config_hash(doc)
    return yaml.safe_dump(doc, sort_keys=False), digest


def newer_operators_file() -> tuple[str, str]:
    """An operator one schema version newer: fields it added, each with its default (the CRD's defaulting
    writes them into every policy's spec), in a section, as a section, and in a list's items."""
    doc = rendered({**SPEC, "pinning": {**SPEC["pinning"], "prompts": [
        {"name": "sys", "model": "m", "tokens": list(range(8))}]}})
    doc["schemaVersion"] += 1
    doc["eviction"]["admissionFilter"] = "none"
    doc["compaction"] = {"enabled": False}
    doc["pinning"]["prompts"][0]["priority"] = 0
    return as_written(doc)


NEW_FIELDS = ("eviction.admissionFilter", "compaction", "pinning.prompts.*.priority")


def metrics(sidecar: Sidecar) -> str:
    return generate_latest(sidecar.metrics.registry).decode()


@pytest.fixture
def sidecar():
    running = Sidecar(SidecarConfig.model_validate({"pageSize": 4}), 64)
    yield running
    running.close()


def test_a_config_one_schema_version_newer_is_applied_without_the_fields_it_added(sidecar, caplog):
    text, digest = newer_operators_file()
    with caplog.at_level(logging.WARNING, logger="kvpool.sidecar"):
        assert sidecar.apply_config_text(text, "config.yaml") == ("applied", None, "")
    config = sidecar.state.config
    assert config.eviction.weights.reuse == 0.5 and config.pinning.quotaPercent == 10
    assert sorted(config.unknown_fields) == sorted(NEW_FIELDS)
    text_metrics = metrics(sidecar)
    assert config_hash_from_metrics(text_metrics) == digest  # the newer operator counts the pod as synced
    version = yaml.safe_load(text)["schemaVersion"]
    assert f'kvpool_config_schema_version{{of="config"}} {float(version)}' in text_metrics
    assert f'kvpool_config_schema_version{{of="sidecar"}} {float(version - 1)}' in text_metrics
    for field in NEW_FIELDS:
        assert f'kvpool_config_unknown_fields{{field="{field}"}} 1.0' in text_metrics
        assert field in sidecar.state.notice and field in caplog.text
    # The next config of this sidecar's own version clears them.
    own, _ = as_written(rendered())
    assert sidecar.apply_config_text(own, "config.yaml")[0] == "applied"
    assert "kvpool_config_unknown_fields{" not in metrics(sidecar) and sidecar.state.notice is None


def test_a_new_pod_starts_on_a_newer_operators_config():
    text, digest = newer_operators_file()
    started = Sidecar(parse_config_text(text), 64)
    try:
        assert config_hash_from_metrics(metrics(started)) == digest
        assert all(field in started.state.notice for field in NEW_FIELDS)
    finally:
        started.close()


def test_a_config_one_schema_version_older_gets_this_sidecars_defaults(sidecar):
    doc = rendered()
    doc["schemaVersion"] -= 1
    del doc["routing"]["minLoad"]  # a field the older operator (and its CRD) does not have
    text, digest = as_written(doc)
    assert sidecar.apply_config_text(text, "config.yaml") == ("applied", None, "")
    assert sidecar.state.config.routing.minLoad == KVCachePolicySpec().routing.minLoad
    assert sidecar.state.config.eviction.weights.reuse == 0.5 and sidecar.state.config.unknown_fields == ()
    assert config_hash_from_metrics(metrics(sidecar)) == digest


@pytest.mark.parametrize(("skew", "upgrade"), [(2, "upgrade the sidecar"), (-2, "upgrade the operator")])
def test_a_config_two_schema_versions_apart_is_refused_naming_schema_version(sidecar, skew, upgrade):
    doc = rendered()
    doc["schemaVersion"] += skew
    text, _ = as_written(doc)
    with pytest.raises(ConfigError) as err:
        parse_config_text(text)
    assert err.value.field == "schemaVersion" and upgrade in str(err.value)
    before = sidecar.state.hash
    result, error, field = sidecar.apply_config_text(text, "config.yaml")
    assert (result, field) == ("invalid", "schemaVersion") and sidecar.state.hash == before


@pytest.mark.parametrize("skew", [None, 0, -1])
def test_a_typo_in_a_config_of_this_or_an_older_schema_version_is_still_refused(skew):
    from kvpool_sidecar.config import SCHEMA_VERSION

    doc = rendered()
    assert doc["schemaVersion"] == SCHEMA_VERSION
    if skew is None:
        del doc["schemaVersion"]  # a hand-written file: read as this sidecar's version
    else:
        doc["schemaVersion"] += skew
    doc["eviction"]["weightz"] = {"reuse": 0.9}
    text, _ = as_written(doc)
    with pytest.raises(ConfigError) as err:
        parse_config_text(text)
    assert err.value.field == "eviction.weightz" and "unknown field" in str(err.value)


def test_a_config_of_an_operator_from_before_schema_versions_is_applied(sidecar):
    """Its file: the fully defaulted spec, no schemaVersion, and source.hash over the canonical JSON of that
    spec (how 0.1.0 wrote it); this sidecar reads it as its own version and checks the hash alike. (Passes
    before the change too: it keeps the way from such an operator open, sidecars first.)"""
    import hashlib
    import json

    spec = KVCachePolicySpec.model_validate(SPEC).model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    doc = {"source": {"name": "chat", "namespace": "llm", "generation": 3, "hash": digest}, **spec}
    assert sidecar.apply_config_text(yaml.safe_dump(doc, sort_keys=False), "config.yaml")[:2] == ("applied", None)
    assert config_hash_from_metrics(metrics(sidecar)) == digest


def contract_fields(model: type, prefix: str = "") -> list[str]:
    """Every field path of a config model, a list item's fields as ``name.*.field``."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        for step, inner in _models_in(field.annotation):
            out += contract_fields(inner, f"{prefix}{name}.{step}")
    return sorted(out)


def _models_in(annotation) -> list[tuple[str, type]]:
    import types
    import typing

    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list:
        return [("*." + step, inner) for step, inner in _models_in(args[0])]
    if origin is typing.Union or origin is types.UnionType:
        return [found for arm in args for found in _models_in(arm)]
    return [("", annotation)] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


# The fingerprint of each schema version's fields. A field added to (or removed from) the config contract needs
# SCHEMA_VERSION + 1 (config.py) and its fingerprint here: docs/upgrades.md.
FINGERPRINTS = {1: "6119be3b", 2: "f58f16f9"}


def test_the_contracts_fields_change_only_with_the_schema_version():
    import hashlib

    from kvpool_sidecar.config import SCHEMA_VERSION

    paths = contract_fields(SidecarConfig)
    assert "workloads.adapters.*.tenant" in paths and "source.hash" in paths
    fingerprint = hashlib.sha256("\n".join(paths).encode()).hexdigest()[:8]
    assert FINGERPRINTS.get(SCHEMA_VERSION) == fingerprint, (
        f"the config contract's fields are not those of schema version {SCHEMA_VERSION}: bump SCHEMA_VERSION "
        f"and record {SCHEMA_VERSION + 1}: {fingerprint!r} (docs/upgrades.md)")


def test_a_version_1_file_with_the_removed_selector_is_applied_without_it(sidecar, caplog):
    """Schema version 2 removed spec.selector (pods bind by the label kvpool.dev/policy): a version-1
    operator's file still carries it; this sidecar drops it, and reports the hash that operator wrote."""
    doc = rendered()
    doc["schemaVersion"] = 1
    doc["selector"] = {"matchLabels": {"app": "qwen-chat"}}
    text, digest = as_written(doc)
    with caplog.at_level(logging.INFO, logger="kvpool.sidecar"):
        assert sidecar.apply_config_text(text, "config.yaml") == ("applied", None, "")
    assert sidecar.state.config.removed_fields == ("selector",) and "selector" in caplog.text
    assert config_hash_from_metrics(metrics(sidecar)) == digest  # the old operator counts the pod synced
    # In a file of this version (or a PUT) the field is refused, saying why.
    doc["schemaVersion"] = 2
    with pytest.raises(ConfigError) as err:
        parse_config_text(as_written(doc)[0])
    assert err.value.field == "selector" and "kvpool.dev/policy" in str(err.value)


def test_a_deleted_policys_running_sidecar_keeps_its_config_and_a_new_one_starts_on_the_defaults(tmp_path, caplog):
    """Deleting a policy empties its pods' optional ConfigMap volume: the running sidecar keeps the config in
    force (said once, kvpool_config_file_missing 1); a sidecar starting there runs on the defaults; when a
    config appears again it is applied."""
    from kvpool_sidecar.service.server import ServeError, ServeOptions, build
    from support import kubelet_projection

    root = tmp_path / "kvpool"
    root.mkdir()
    text, digest = as_written(rendered())
    kubelet_projection(root, text, 1)
    options = ServeOptions(config=str(root / "config.yaml"), pages=64, engine_socket=None)
    running, _ = build(options)
    try:
        assert running.state.hash == digest
        (root / "config.yaml").unlink()  # kubelet: the ConfigMap is gone, its file with it
        with caplog.at_level(logging.WARNING, logger="kvpool.sidecar"):
            assert running.poll_config_file() is None and running.poll_config_file() is None
        assert running.state.hash == digest and running.state.last_error is None
        assert running.config_view()["file_missing"] and caplog.text.count("is absent") == 1
        assert "kvpool_config_file_missing 1.0" in metrics(running)

        fresh, _ = build(options)  # a rescheduled pod: the defaults
        try:
            assert fresh.state.config == SidecarConfig() and fresh.state.config.source is None
            assert "kvpool_config_file_missing 1.0" in metrics(fresh)
        finally:
            fresh.close()

        kubelet_projection(root, text.replace("reuse: 0.5", "reuse: 0.4"), 2)  # a policy of that name again
        assert running.poll_config_file(settled=True) == "invalid"  # edited by hand: its hash no longer matches
        again = rendered({**SPEC, "eviction": {"policy": "lru", "weights": {"reuse": 0.4}}})
        (root / "config.yaml").unlink()
        kubelet_projection(root, as_written(again)[0], 3)
        assert running.poll_config_file(settled=True) == "applied"
        assert running.state.config.eviction.weights.reuse == 0.4 and "kvpool_config_file_missing 0.0" in \
            metrics(running)
    finally:
        running.close()
    with pytest.raises(ServeError, match="neither the file nor its directory"):
        build(ServeOptions(config=str(tmp_path / "typo" / "config.yaml"), pages=64, engine_socket=None))


def test_a_config_that_appears_while_a_sidecar_starts_on_the_defaults_is_applied(tmp_path, monkeypatch):
    """Policy and pods applied together: the sidecar reads no file and starts on the defaults, and the
    kubelet projects the ConfigMap while the pool is still being set up. The file's content is not taken
    as already applied: the next poll applies it (else the pod stays on the defaults, never synced)."""
    from kvpool_sidecar.service import server
    from support import kubelet_projection

    root = tmp_path / "kvpool"
    root.mkdir()
    text, digest = as_written(rendered({**SPEC, "pageSize": SidecarConfig().pageSize}))  # one a live reload takes
    started = server.initial_config

    def then_projected(path):
        config = started(path)
        kubelet_projection(root, text, 1)  # after the read, before the sidecar is built
        return config

    monkeypatch.setattr(server, "initial_config", then_projected)
    sidecar, _ = server.build(server.ServeOptions(config=str(root / "config.yaml"), pages=64, engine_socket=None))
    try:
        assert sidecar.state.config == SidecarConfig()
        assert sidecar.poll_config_file(settled=True) == "applied", sidecar.state.last_error
        assert sidecar.state.hash == digest
    finally:
        sidecar.close()
