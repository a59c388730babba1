"""What a pool key must carry besides the engine's block hash: the identity of the model that computed it.

vLLM's block hashes cover tokens and extra keys (LoRA, multimodal, cache salt), not the weights: two
engines serving different weights of the same shape hash a prompt alike. The connector therefore names
its model in its hello, and the sidecar namespaces every key by it. The identity holds the model's name
and revision, the tokenizer, dtypes, the KV layout (block size, layers, heads, head size), and for weights
on a local disk every weight file's name, size and modification time (cheap, and it changes when the
weights are replaced in place).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


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


def model_identity(vllm_config: Any, kv_cache_config: Any) -> str:
    """A stable string naming the served model and its KV layout (vLLM objects read by attribute)."""
    mc = getattr(vllm_config, "model_config", None)
    cc = getattr(vllm_config, "cache_config", None)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    spec = groups[0].kv_cache_spec if groups else None
    model = str(getattr(mc, "model", ""))
    ident = {
        "model": model,
        "revision": str(getattr(mc, "revision", None)),
        "tokenizer": str(getattr(mc, "tokenizer", None)),
        "dtype": str(getattr(mc, "dtype", None)),
        "cache_dtype": str(getattr(cc, "cache_dtype", None)),
        "block_size": getattr(cc, "block_size", None),
        "layers": len(groups[0].layer_names) if groups else None,
        "kv_spec": repr(spec),
        "weights": weight_files(model),
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return f"{model[-200:]}@{digest}"
