"""Test-wide setup. The Triton interpreter must be chosen before any kernel module is imported."""

import os
import socket
from collections.abc import Iterator

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _no_segments_left_behind() -> Iterator[None]:
    """A named sidecar's exit may leave its pool's segment for its restart to take over (a SIGKILL, or a
    SIGTERM while an engine maps it); at the end of the session those the tests' sidecars left are
    removed (a segment a sidecar or an engine still holds, another session's, stays)."""
    yield
    from kvpool_sidecar.storage.segment import release_instance

    release_instance("", prefix=f"kvpool-{socket.gethostname()}-")
