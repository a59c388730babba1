"""What a pool key must carry besides the engine's block hash: the identity of the model that computed it.

vLLM's block hashes cover tokens and extra keys (LoRA, multimodal, cache salt), not the weights: two
engines serving different weights of the same shape hash a prompt alike. The connector and the tier
therefore name their model in their hello (the tier's :func:`chunk_identity` adds its chunk's layout to
the same :func:`model_identity`), and the sidecar namespaces every key by it. The identity holds
everything that changes the KV bytes a prompt leaves behind:

* the weights: for a local folder every weight file's name, size and modification time (cheap, and it
  changes when the weights are replaced in place); for a hub name the commit of the snapshot the engine
  loaded (a content address: re-pulled weights of another commit are another identity) and its files;
* the model's config as the engine applied it (``hf_config``: RoPE scaling, ``hf_overrides``), its
  quantization, dtypes and KV cache dtype (fp8 scales come with the weights or ``calculate_kv_scales``);
* the KV layout (block size, layers, the KV cache spec, the tensor-parallel degree) and the block-hash
  function.

The engine's block hashes must also be the same across its restarts, or every page is unreachable
after one: :func:`hash_seed_problem` names the setting that breaks that.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# vLLM's block-hash functions that are not collision resistant: it seeds them from os.urandom unless
# PYTHONHASHSEED is set (resolve_none_hash_seed in vLLM's v1 kv_cache_utils module).
RANDOM_SEEDED_HASHES = ("xxhash", "xxhash_cbor")


def weight_files(model: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the weight files of a local model directory; [] for a hub name."""
    folder = Path(model)
    if not folder.is_dir():
        return []
    out = []
    for f in sorted(folder.iterdir()):
        if f.suffix in WEIGHT_SUFFIXES and f.is_file():
            st = f.stat()
            out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def hub_snapshot(model: str, revision: str | None) -> str | None:
    """The local snapshot a hub-named model was loaded from (its folder name is the commit hash), or
    None for a local folder or a model that is not in the Hugging Face cache."""
    if not model or Path(model).is_dir():
        return None
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:  # not cached, not a hub id, offline without it: the name and revision must do
        return None
    return str(path) if isinstance(path, str) else None


UNSTABLE_CONFIG_KEYS = ("transformers_version",)  # not the model: an upgrade of the library changes it


def _config_of(mc: Any) -> Any:
    hf = getattr(mc, "hf_config", None)
    to_dict = getattr(hf, "to_dict", None)
    if not callable(to_dict):
        return hf
    return {k: v for k, v in to_dict().items() if k not in UNSTABLE_CONFIG_KEYS and not k.startswith("_")}


def model_identity(vllm_config: Any, kv_cache_config: Any, ranks: int = 1) -> str:
    """A stable string naming the served model and its KV layout (vLLM objects read by attribute);
    ``ranks``: the tensor-parallel workers whose shares a page holds, in their order (part of the layout)."""
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    spec = groups[0].kv_cache_spec if groups else None
    model = str(getattr(mc, "model", ""))
    revision = getattr(mc, "revision", None)
    snapshot = hub_snapshot(model, revision)
    ident = {
        "model": model,
        "revision": str(revision),
        "snapshot": Path(snapshot).name if snapshot else None,
        "tokenizer": str(getattr(mc, "tokenizer", None)),
        "dtype": str(getattr(mc, "dtype", None)),
        "quantization": str(getattr(mc, "quantization", None)),
        "hf_config": _config_of(mc),
        "hf_overrides": getattr(mc, "hf_overrides", None),
        "cache_dtype": str(getattr(cc, "cache_dtype", None)),
        "kv_scales": str(getattr(cc, "calculate_kv_scales", None)),
        "hash": str(getattr(cc, "prefix_caching_hash_algo", None)),
        "block_size": getattr(cc, "block_size", None),
        "layers": len(groups[0].layer_names) if groups else None,
        "kv_spec": repr(spec),
        "tensor_parallel": ranks,
        "weights": weight_files(snapshot or model),
    }
    return _named(model, ident)


def _named(model: str, ident: dict[str, Any]) -> str:
    """``model``'s name, then a digest of everything the identity holds."""
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return f"{model[-200:]}@{digest}"


class IdentityError(ValueError):
    """The engine's configuration would make its pages unreachable or ambiguous (a start-up refusal)."""


def hash_seed_problem(vllm_config: Any, environ: dict[str, str] | None = None) -> str | None:
    """Why the engine's block hashes would change at its next start (so every page it saved would be
    unreachable), or None when they are stable."""
    env = os.environ if environ is None else environ
    algo = str(getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", "sha256"))
    if algo in RANDOM_SEEDED_HASHES and env.get("PYTHONHASHSEED") is None:
        return (f"prefix_caching_hash_algo={algo} without PYTHONHASHSEED seeds vLLM's block hashes at random in "
                "every process: a restarted engine would find none of the pages it saved. Set PYTHONHASHSEED "
                "(the same value in every engine of this model, kept secret) or use sha256")
    return None


def chunk_identity(config: Any, vllm_config: Any = None) -> str:
    """The identity of vLLM's offloaded chunks as the tier stores them (an ``OffloadingConfig`` read by
    attribute): the engine's model as :func:`model_identity` names it (from ``vllm_config``, the engine's
    ``VllmConfig``; without it from the model's name alone: its snapshot and weight files, not its
    quantization, ``hf_overrides``, revision or tokenizer), the cache dtype, the chunk's geometry and every
    worker's share of it. Another layout, degree or model never meets these pages, nor does
    ``KVPoolConnector``'s block layout."""
    model = str(config.model.name)
    engine = vllm_config if vllm_config is not None else SimpleNamespace(model_config=SimpleNamespace(model=model))
    ident = {
        "layout": "vllm-offload-chunk",
        "model": model_identity(engine, None),
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "world_size": config.parallel.world_size,
        "tensor_parallel": config.parallel.tp_size,
        "replicated": bool(getattr(config, "replicated_layout", False)),
        "canonical": bool(getattr(config, "canonical_layout", False)),
        "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
        "groups": [list(g.layer_names) for g in config.groups],
    }
    return _named(model, ident)
