"""KV storage: the pool's pages as torch tensors, Triton kernels that move KV in and out of them."""

from kvpool_sidecar.storage.backend import Backend, choose_backend
from kvpool_sidecar.storage.tensors import Fenced, KVStorage, ModelShape, NoFenceSlot, StaleHandle

__all__ = ["Backend", "Fenced", "KVStorage", "ModelShape", "NoFenceSlot", "StaleHandle", "choose_backend"]
