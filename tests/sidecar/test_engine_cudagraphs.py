"""What vLLM's own configuration makes of ``KVPoolConnector`` (issue 61): each attention layer waits for its
own loaded rows, Python that a full CUDA graph's replay skips, so vLLM must never run full graphs with it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

if os.environ.get("KVPOOL_REQUIRE_ENGINE"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="needs the vllm extra (make test installs it)")

from tiny_model import build_tiny_model


def resolved_cudagraph_mode(model: Path, connector: bool, gpu_compilation: bool) -> Any:
    """The CUDA-graph mode vLLM's config resolves when asked for its default FULL_AND_PIECEWISE, as on a
    platform with static graphs (a GPU): this CPU platform's claim patched, vLLM's resolution its own.
    ``gpu_compilation``: without the CPU's fallback for piecewise graphs (they need vLLM's compilation
    mode, which the CPU platform replaces), so the mode is what a GPU would run."""
    from vllm.config import CompilationConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.platforms import current_platform

    kv = KVTransferConfig(kv_connector="KVPoolConnector", kv_connector_module_path="kvpool_sidecar.engines.vllm",
                          kv_role="kv_both") if connector else None
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(type(current_platform), "support_static_graph_mode",
                                                classmethod(lambda cls: True)))
        if gpu_compilation:
            patches.enter_context(mock.patch.object(VllmConfig, "_normalize_piecewise_cudagraph_mode"))
        config = VllmConfig(model_config=ModelConfig(model=str(model)), kv_transfer_config=kv,
                            compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"))
    return config.compilation_config.cudagraph_mode


def test_vllm_runs_piecewise_cuda_graphs_with_the_connector_never_full_ones(tmp_path):
    """vLLM's default FULL_AND_PIECEWISE resolves to PIECEWISE with KVPoolConnector (full graphs without
    it); with the CPU's own fallback as well, the connector leaves no full graph (NONE) where vLLM alone
    keeps them for decode batches (FULL_DECODE_ONLY)."""
    from vllm.config.compilation import CUDAGraphMode

    model = build_tiny_model(tmp_path / "model", seed=0)
    assert resolved_cudagraph_mode(model, connector=True, gpu_compilation=True) == CUDAGraphMode.PIECEWISE
    assert resolved_cudagraph_mode(model, connector=False, gpu_compilation=True) == CUDAGraphMode.FULL_AND_PIECEWISE
    assert not resolved_cudagraph_mode(model, connector=True, gpu_compilation=False).has_full_cudagraphs()
    assert resolved_cudagraph_mode(model, connector=False, gpu_compilation=False).has_full_cudagraphs()


def test_a_cuda_engine_runs_the_connectors_never_run_copy_path_only_when_opted_in(caplog):
    """The connector's own CUDA copies have never run on a GPU: a CUDA engine refuses to start with it,
    naming the path to use instead and the opt-in; opted in, it starts with a warning naming that code.
    A CPU engine is not concerned."""
    import logging
    from types import SimpleNamespace

    import torch
    from kvpool_sidecar.engines.blocks import LayoutError, check_cuda_path
    from kvpool_sidecar.engines.settings import parse_settings

    gpu = [SimpleNamespace(rows=SimpleNamespace(device=torch.device("cuda", 0)))]
    cpu = [SimpleNamespace(rows=torch.zeros(2, 2))]
    with pytest.raises(LayoutError, match=r"never run on a GPU.*KVPoolTier.*untested_cuda: true"):
        check_cuda_path(gpu, parse_settings({}).untested_cuda)
    with caplog.at_level(logging.WARNING, logger="kvpool.engine"):
        check_cuda_path(gpu, parse_settings({"untested_cuda": True}).untested_cuda)
        check_cuda_path(cpu, False)
    assert caplog.text.count("copy streams") == 1
