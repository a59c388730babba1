"""Test-only: point kopf and the kubernetes client at the emulator (KVPOOL_TEST_KUBE_URL)."""

import os
from typing import Any

import kopf


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=os.environ["KVPOOL_TEST_KUBE_URL"], insecure=True)


@kopf.on.startup()
def settings(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.scanning.disabled = True  # the emulator cannot list namespaces
    settings.watching.server_timeout = 10
