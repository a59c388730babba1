"""The model identity that namespaces an engine's keys covers what changes KV bytes, and the engine's
block hashes must survive its restart (issue 51)."""

from __future__ import annotations

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
