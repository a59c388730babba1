"""Which implementation moves the bytes: compiled Triton on CUDA, the Triton interpreter when
``TRITON_INTERPRET=1`` (tests on CPU), plain torch otherwise. The choice is explicit and reported."""

from __future__ import annotations

import enum
import os

import torch


class Backend(str, enum.Enum):
    TRITON = "triton"  # compiled kernels on a CUDA device
    TRITON_INTERPRETER = "triton-interpreter"  # the same kernels, interpreted on the CPU (tests)
    TORCH = "torch"  # reference implementation, the runtime fallback


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(device: torch.device, requested: str | None = None) -> Backend:
    """``requested`` ("triton", "triton-interpreter", "torch") or the best for ``device``."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if requested is not None:
        backend = Backend(requested)
        if backend is Backend.TRITON and (device.type != "cuda" or interpret or not triton_available()):
            raise ValueError("backend 'triton' needs a CUDA device, triton, and TRITON_INTERPRET unset")
        if backend is Backend.TRITON_INTERPRETER and (not interpret or not triton_available()):
            raise ValueError("backend 'triton-interpreter' needs triton and TRITON_INTERPRET=1 set before import")
        return backend
    if triton_available():
        if interpret:
            return Backend.TRITON_INTERPRETER
        if device.type == "cuda":
            return Backend.TRITON
    return Backend.TORCH
