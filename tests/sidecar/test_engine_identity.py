"""The model identity that namespaces an engine's keys covers what changes KV bytes, and the engine's
block hashes must survive its restart (issue 51)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from kvpool_sidecar.engines.identity import hash_seed_problem, model_identity


class HFConfig:
    def __init__(self, **fields) -> None:
        self.fields = fields

    def to_dict(self) -> dict:
        return dict(self.fields)


def config(model: str = "org/tiny", revision: str | None = None, quantization: str | None = None,
           rope: dict | None = None, overrides: dict | None = None, cache_dtype: str = "auto",
           algo: str = "sha256", transformers: str = "4.57.0") -> SimpleNamespace:
    hf = HFConfig(architectures=["LlamaForCausalLM"], rope_scaling=rope, transformers_version=transformers)
    mc = SimpleNamespace(model=model, revision=revision, tokenizer=model, dtype="bfloat16", quantization=quantization,
                         hf_config=hf, hf_overrides=overrides)
    cc = SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=False, prefix_caching_hash_algo=algo,
                         block_size=16)
    return SimpleNamespace(model_config=mc, cache_config=cc)


KV = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec="full(heads=4)", layer_names=["l0", "l1"])])


def test_what_changes_kv_bytes_changes_the_identity_and_nothing_else_does():
    base = model_identity(config(), KV)
    assert model_identity(config(), KV) == base  # stable: a restart keeps it
    assert model_identity(config(transformers="5.0.0"), KV) == base  # a library upgrade is not a model
    for changed in (config(quantization="fp8"), config(rope={"type": "yarn", "factor": 4.0}),
                    config(overrides={"max_position_embeddings": 65536}), config(cache_dtype="fp8_e4m3"),
                    config(algo="sha256_cbor"), config(revision="v2")):
        assert model_identity(changed, KV) != base


def test_a_hub_model_is_named_by_the_snapshot_it_was_loaded_from(tmp_path, monkeypatch):
    """Weights pulled again at another commit are another model, though name and revision are the same."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "model.safetensors").write_bytes(commit.encode())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    first = model_identity(config(), KV)
    assert model_identity(config(), KV) == first
    (repo / "refs" / "main").write_text("b" * 40)  # re-pulled: main moved to a new commit
    assert model_identity(config(), KV) != first


@pytest.mark.parametrize(("algo", "env", "refused"), [
    ("sha256", {}, False),  # vLLM's default: a fixed seed unless PYTHONHASHSEED names one
    ("xxhash", {}, True),  # seeded from os.urandom in every process
    ("xxhash", {"PYTHONHASHSEED": "7"}, False),
    ("xxhash_cbor", {}, True),
])
def test_an_engine_whose_block_hashes_would_change_at_restart_is_refused(algo, env, refused):
    problem = hash_seed_problem(config(algo=algo), env)
    assert (problem is not None) == refused
    if refused:
        assert f"prefix_caching_hash_algo={algo}" in problem and "PYTHONHASHSEED" in problem


@pytest.mark.parametrize("seed_env", [None, "1234"])
def test_the_sidecar_names_blocks_from_token_ids_exactly_as_vllm_hashes_them(seed_env, monkeypatch):
    """One key space: what a pin by token ids computes is the block hash vLLM gives the same tokens."""
    pytest.importorskip("vllm")
    import random

    from kvpool_sidecar.errors import InvalidRequest
    from kvpool_sidecar.keys import engine_block_hashes
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens, resolve_none_hash_seed

    if seed_env is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed_env)
    fn = get_hash_fn_by_name("sha256")
    seed = resolve_none_hash_seed(fn)
    rng = random.Random(7)
    tokens = [rng.randrange(150_000) for _ in range(5 * 16 + 9)]
    parent, want = BlockHash(fn(seed)), []
    for i in range(5):
        parent = hash_block_tokens(fn, parent, tokens[i * 16 : (i + 1) * 16], None)
        want.append(bytes(parent))
    assert engine_block_hashes(tokens, 16, "sha256", seed) == want  # the partial last block has none
    with pytest.raises(InvalidRequest, match="'sha256_cbor': the sidecar computes only sha256"):
        engine_block_hashes(tokens, 16, "sha256_cbor", seed)


@pytest.fixture(scope="module")
def tier_engine(tmp_path_factory):
    """A VllmConfig as vLLM's engine core holds it (the tiny model, offline), whose offloading's secondary
    tier is kvpool (no sidecar: the tier starts without one)."""
    pytest.importorskip("vllm")
    from tiny_model import build_tiny_model
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    folder = tmp_path_factory.mktemp("tier-identity")
    model = build_tiny_model(folder / "model")
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * 4096, "block_size": 16,
             "secondary_tiers": [{"type": "KVPoolTier", "module_path": "kvpool_sidecar.engines.tier",
                                  "socket": str(folder / "no-sidecar.sock")}]}
    return VllmConfig(model_config=ModelConfig(model=str(model)), cache_config=CacheConfig(block_size=16),
                      kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                                          kv_connector_extra_config=extra))


def changed(vllm_config, part: str = "model_config", **fields):
    """A copy of ``vllm_config`` with ``fields`` of its ``part`` set."""
    import copy

    out = copy.deepcopy(vllm_config)
    for name, value in fields.items():
        setattr(getattr(out, part), name, value)
    return out


def tier_identity_built_by_vllm(vllm_config) -> str:
    """The identity of the kvpool tier vLLM builds for ``vllm_config`` as its engine core does: its
    scheduler's ``KVConnectorFactory.create_connector`` (OffloadingConnector, then
    TieringOffloadingSpec.get_manager), which no ``set_current_vllm_config`` context surrounds."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    try:
        connector = KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.SCHEDULER,
                                                        kv_cache_config=kv)
        try:
            [tier] = connector.connector_scheduler.manager.secondary_tiers
            return tier.model
        finally:
            connector.shutdown()
    finally:  # vLLM's primary region (its scheduler side may leave the file behind)
        Path(f"/dev/shm/vllm_offload_{vllm_config.kv_transfer_config.engine_id}.mmap").unlink(missing_ok=True)


def test_the_tier_vllms_engine_core_builds_refuses_block_hashes_a_restart_would_change(tier_engine, monkeypatch):
    """vLLM's engine core builds the tier with no current config set: the tier still finds the engine's
    and refuses xxhash without PYTHONHASHSEED, naming both settings, as the connector does."""
    from kvpool_sidecar.engines.identity import IdentityError

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    engine = changed(tier_engine, "cache_config", prefix_caching_hash_algo="xxhash")
    with pytest.raises(IdentityError, match=r"KVPoolTier: prefix_caching_hash_algo=xxhash .*PYTHONHASHSEED"):
        tier_identity_built_by_vllm(engine)
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    tier_identity_built_by_vllm(engine)  # seeded: its hashes survive a restart


def test_the_tiers_identity_covers_what_changes_kv_bytes_as_vllms_engine_core_builds_it(tier_engine):
    """Two engines of the same model name and KV layout that differ in quantization, hf_overrides,
    revision or tokenizer never share the tier's pages; the same engine again does."""
    base = tier_identity_built_by_vllm(tier_engine)
    assert tier_identity_built_by_vllm(changed(tier_engine)) == base
    for fields in ({"quantization": "fp8"}, {"hf_overrides": {"max_position_embeddings": 65536}},
                   {"revision": "v2"}, {"tokenizer": "org/other-tokenizer"}):
        assert tier_identity_built_by_vllm(changed(tier_engine, **fields)) != base, fields


def test_the_tiers_identity_in_vllms_engine_core_is_the_whole_one(tier_engine):
    """The identity the tier takes where vLLM's engine core builds it (no current config) is the one it
    takes with vLLM's config current: nothing of the engine's is left out."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(tier_engine):
        with_config = tier_identity_built_by_vllm(tier_engine)
    assert tier_identity_built_by_vllm(tier_engine) == with_config
