"""``SlowCopiesConnector``: kvpool's connector with its copies held back on the worker's copy lanes, before
any byte moves: every save ``KVPOOL_SLOW_SAVE_S`` seconds (1 by default), every layer of a step's loads
``KVPOOL_SLOW_LOAD_S`` seconds (0 by default). Deliberately slow copies (fault injection for the engine
tests): a test can kill an engine while its saves are queued, or check that each attention layer waits
for its own layer's loaded rows before it reads them.

Load it as the connector with ``"kv_connector": "SlowCopiesConnector"`` and
``"kv_connector_module_path": "slow_copies"``, this folder on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from kvpool_sidecar.engines.vllm import KVPoolConnector


class SlowCopiesConnector(KVPoolConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        copier = self._worker.copier
        for name, variable, default in (("save", "KVPOOL_SLOW_SAVE_S", "1.0"),
                                        ("load_layer", "KVPOOL_SLOW_LOAD_S", "0")):
            delay = float(os.environ.get(variable, default))
            if delay > 0:
                setattr(copier, name, _late(getattr(copier, name), delay))


def _late(copy: Any, delay: float) -> Any:
    def late(*args: Any) -> None:
        time.sleep(delay)
        copy(*args)

    return late
