"""Reconcile latency: policy patch -> ConfigMap updated, median over N updates.

    .venv/bin/python bench/reconcile_latency.py [--updates 20]

The operator runs for real (kopf) against KMock's Kubernetes emulator on 127.0.0.1 (the same
emulator as the integration tests), so the figure is kopf's and ours, not a real API server's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import kubernetes
import yaml
from kopf.testing import KopfRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from emulator import running_emulator
from test_operator_kmock import GROUP, NS, PLURAL, VERSION, operator_args, policy, wait_watching


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=20)
    args = parser.parse_args()
    with running_emulator() as (_, emulator):
        api, core = kubernetes.client.CustomObjectsApi(), kubernetes.client.CoreV1Api()
        with KopfRunner(operator_args()):
            wait_watching(emulator)
            api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy("bench", {"reuse": 0.5}))
            while True:
                try:
                    core.read_namespaced_config_map("kvpool-bench", NS)
                    break
                except kubernetes.client.rest.ApiException:
                    time.sleep(0.01)
            samples = []
            for i in range(args.updates):
                reuse = round(0.51 + i * 0.02, 2)
                start = time.perf_counter()
                api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, "bench", {"spec": {"eviction": {
                    "weights": {"reuse": reuse}}}})
                while True:
                    data = core.read_namespaced_config_map("kvpool-bench", NS).data["config.yaml"]
                    if yaml.safe_load(data)["eviction"]["weights"]["reuse"] == reuse:
                        break
                    time.sleep(0.005)
                samples.append(time.perf_counter() - start)
    samples.sort()
    median = statistics.median(samples) * 1000
    print(f"policy patch -> ConfigMap updated, {len(samples)} updates: median {median:.0f} ms, "
          f"min {samples[0] * 1000:.0f} ms, max {samples[-1] * 1000:.0f} ms")


if __name__ == "__main__":
    main()
