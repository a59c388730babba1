from collections.abc import Iterator

import pytest
from kvpool_sidecar.service.state import Sidecar
from support import live_sidecar


@pytest.fixture
def sidecar_url() -> Iterator[tuple[str, Sidecar]]:
    with live_sidecar() as live:
        yield live
