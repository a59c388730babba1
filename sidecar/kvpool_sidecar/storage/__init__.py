"""KV storage: the pool's pages as torch tensors, Triton kernels that move KV in and out of them."""

from kvpool_sidecar.storage.backend import Backend, choose_backend
from kvpool_sidecar.storage.tensors import KVStorage, ModelShape, StaleHandle

__all__ = ["Backend", "KVStorage", "ModelShape", "StaleHandle", "choose_backend"]
