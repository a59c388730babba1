"""Test-wide setup. The Triton interpreter must be chosen before any kernel module is imported."""

import os
import socket
from collections.abc import Iterator

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

SHM = "/dev/shm"


@pytest.fixture(autouse=True, scope="session")
def _no_segments_left_behind() -> Iterator[None]:
    """A named sidecar's exit may leave its pool's segment for its restart to take over (a SIGKILL, or a SIGTERM
    while an engine maps it); the tests'
    sidecars are all gone at the end of the session, so the segments they left are removed then."""
    prefix = f"kvpool-{socket.gethostname()}-"
    before = {n for n in os.listdir(SHM) if n.startswith(prefix)}
    yield
    for name in os.listdir(SHM):
        if name.startswith(prefix) and name not in before:
            try:
                os.unlink(os.path.join(SHM, name))
            except FileNotFoundError:
                pass
