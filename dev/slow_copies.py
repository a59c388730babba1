"""``SlowSavesConnector``: kvpool's connector with every save's copy held back ``KVPOOL_SLOW_SAVE_S``
seconds (1 by default) on the worker's copy queue, before any byte is written: a deliberately slow copy,
so that a test can kill an engine while its saves are queued (fault injection for the engine tests).

Load it as the connector with ``"kv_connector": "SlowSavesConnector"`` and
``"kv_connector_module_path": "slow_copies"``, this folder on the engine's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from kvpool_sidecar.engines.vllm import KVPoolConnector


class SlowSavesConnector(KVPoolConnector):
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        assert self._worker is not None
        copier, delay = self._worker.copier, float(os.environ.get("KVPOOL_SLOW_SAVE_S", "1.0"))
        write = copier.save

        def slow_save(*args: Any) -> None:
            time.sleep(delay)
            write(*args)

        copier.save = slow_save  # type: ignore[method-assign]
