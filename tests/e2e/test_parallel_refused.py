"""Pipeline parallelism is refused at start-up, naming the setting (a stage holds some of the layers;
tensor parallelism is supported: test_vllm_tensor_parallel.py). vLLM's own config objects, no engine."""

from __future__ import annotations

import os

import pytest

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="the engine tests need the vllm extra (make test installs it)")

from engine_support import BLOCK, CONNECTOR, engine_env, environment
from kvpool_sidecar.engines.blocks import LayoutError
from tiny_model import build_tiny_model


@pytest.mark.parametrize("setting", ["pipeline_parallel_size"])
def test_a_pipeline_parallel_engine_is_refused_naming_the_setting(tmp_path_factory, setting):
    from kvpool_sidecar.engines.vllm import KVPoolConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs

    model = build_tiny_model(tmp_path_factory.mktemp("model"))
    with environment(engine_env()):
        config = EngineArgs(model=str(model), dtype="float32", block_size=BLOCK, max_model_len=2048,
                            enforce_eager=True, **{setting: 2},
                            kv_transfer_config={"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                                                "kv_connector_module_path": CONNECTOR}).create_engine_config()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(LayoutError, match=f"{setting}=2"):
            KVPoolConnector(config, role, None)


@pytest.mark.parametrize("kinds", [("sliding",), ("full", "sliding")])
def test_a_sliding_window_or_hybrid_model_is_refused_naming_its_group_kinds(tmp_path_factory, kinds):
    """A sliding-window group's blocks past its window are vLLM's null block: refused, not guessed."""
    import torch
    from kvpool_sidecar.engines.vllm import KVPoolConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    model = build_tiny_model(tmp_path_factory.mktemp("model"))
    with environment(engine_env()):
        config = EngineArgs(model=str(model), dtype="float32", block_size=BLOCK, max_model_len=2048,
                            enforce_eager=True,
                            kv_transfer_config={"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                                                "kv_connector_module_path": CONNECTOR}).create_engine_config()
    spec = {"full": FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32),
            "sliding": SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                         sliding_window=128)}
    groups = [KVCacheGroupSpec([f"layer.{i}"], spec[k]) for i, k in enumerate(kinds)]
    kv_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    with pytest.raises(LayoutError, match="SlidingWindowSpec") as refused:
        KVPoolConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    assert f"this model has {len(kinds)}" in str(refused.value)
