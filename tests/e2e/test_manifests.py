"""What a cluster admin applies: manifests valid offline, kustomizations complete, rules loadable,
the dashboard asking only for metrics the sidecar exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml
from kvpool_sidecar.client import SidecarClient
from kvpool_sidecar.config import SidecarConfig
from support import live_sidecar

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
K8S_VERSION = "1.37.0"
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "KVCachePolicy", "Kustomization", "InferencePool"}


def all_containers(pod: dict) -> list[dict]:
    """A pod spec's containers, its native sidecars (init containers that keep running) first."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def documents() -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path, doc))
    return out


@pytest.mark.parametrize(("path", "doc"), documents(), ids=lambda v: v.name if isinstance(v, Path) else v["kind"])
def test_manifest_validates_against_the_kubernetes_schemas(path, doc):
    if doc["kind"] in CUSTOM_KINDS:
        pytest.skip(f"{doc['kind']} is a custom resource: checked by its own test")
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", sorted(MANIFESTS.rglob("kustomization.yaml")), ids=str)
def test_kustomizations_list_only_files_that_exist(kustomization):
    spec = yaml.safe_load(kustomization.read_text())
    listed = list(spec.get("resources", []))
    for gen in spec.get("configMapGenerator", []):
        listed += gen.get("files", [])
    assert listed
    for entry in listed:
        target = (kustomization.parent / entry).resolve()
        assert target.exists(), f"{kustomization}: {entry} does not exist"
        assert MANIFESTS in target.parents, f"{entry}: kustomize loads only below the kustomization root"


def test_the_example_pods_are_bound_to_the_example_policy():
    """inference.yaml's pods carry the label naming policy.yaml's policy, their sidecar mounts its ConfigMap
    (what the operator checks: no PodsMisbound), optionally (a pod starts before the policy is rendered or
    after it is deleted, on the defaults)."""
    from kvpool_operator.status import bind

    docs = {doc["kind"]: doc for path, doc in documents() if path.name in ("inference.yaml", "policy.yaml")}
    name = docs["KVCachePolicy"]["metadata"]["name"]
    template = docs["Deployment"]["spec"]["template"]
    pod = {**template, "status": {"phase": "Running"}}
    binding = bind(name, [pod])
    assert len(binding.targets) == 1 and binding.misbound == []
    volumes = [v for v in template["spec"]["volumes"] if (v.get("configMap") or {}).get("name") == f"kvpool-{name}"]
    assert [v["configMap"].get("optional") for v in volumes] == [True]


def test_copies_stay_equal_to_their_sources():
    assert (MANIFESTS / "base" / "crd.yaml").read_text() == (ROOT / "crds" / "kvcachepolicy.yaml").read_text()
    policy = (MANIFESTS / "examples" / "policy.yaml").read_text()
    assert policy == (ROOT / "crds" / "examples" / "chat.yaml").read_text()


def test_rbac_is_least_privilege():
    rbac = [d for _, d in documents() if d["kind"] in ("ClusterRole", "Role")]
    assert rbac
    for role in rbac:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            if "pods" in rule["resources"]:
                assert set(rule["verbs"]) <= {"get", "list", "watch"}
    bindings = [d for _, d in documents() if d["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert all(b["roleRef"]["name"] != "cluster-admin" for b in bindings)


def test_the_operator_deployment_is_hardened():
    deploy = next(d for _, d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpool-operator")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["limits"] and container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def rule_groups() -> dict:
    return yaml.safe_load((MANIFESTS / "monitoring" / "rules.yaml").read_text())["spec"]


RUNBOOKS = "https://github.com/kvpool/kvpool/blob/main/docs/troubleshooting.md#"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (make test installs it)")


def alerts() -> list[dict]:
    return [r for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r]


@needs_promtool
def test_promtool_accepts_the_alert_rules(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups()))
    proc = subprocess.run(["promtool", "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(alerts()) == 14
    headings = {re.sub(r"[^a-z0-9 -]", "", line[3:].lower()).replace(" ", "-")
                for line in (ROOT / "docs" / "troubleshooting.md").read_text().splitlines() if line.startswith("## ")}
    for alert in alerts():  # every runbook link lands on a section; the prose is the description
        annotations = alert["annotations"]
        assert "runbook" not in annotations and annotations["summary"] and annotations["description"]
        assert annotations["runbook_url"].startswith(RUNBOOKS), alert["alert"]
        anchor = annotations["runbook_url"].removeprefix(RUNBOOKS)
        assert anchor in headings, f"{alert['alert']}: no section #{anchor} in docs/troubleshooting.md"


@needs_promtool
def test_every_alert_fires_on_what_it_watches_and_not_on_healthy_neighbours(tmp_path):
    """promtool's unit tests (tests/e2e/alerts_test.yaml): each alert fires after its `for` on the series
    that should raise it, with the labels and summary an on-call engineer reads, and not on the healthy
    series beside them. The test file lists the templated annotations; the fixed ones come from the rule."""
    cases = yaml.safe_load((Path(__file__).parent / "alerts_test.yaml").read_text())
    fixed = {a["alert"]: {k: v for k, v in a["annotations"].items() if "{{" not in v} for a in alerts()}
    fired = set()
    for case in cases["tests"]:
        for check in case["alert_rule_test"]:
            for expected in check["exp_alerts"]:
                expected["exp_annotations"] = fixed[check["alertname"]] | expected.get("exp_annotations", {})
                fired.add(check["alertname"])
    assert fired == set(fixed), f"alerts no test sees fire: {sorted(set(fixed) - fired)}"
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(cases, sort_keys=False))
    proc = subprocess.run(["promtool", "test", "rules", "alerts_test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def exported_metric_names() -> set[str]:
    with live_sidecar() as (url, _), SidecarClient(url) as c:
        for i in range(3):
            c.admit(f"s{i}", [1, 2, 3, 4, 5, 6, 7, 8, i])
            c.commit(f"s{i}", 9)
            c.release(f"s{i}")
        text = c.metrics()
    return sample_names(text) | operator_metric_names()


def sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def operator_metric_names() -> set[str]:
    """What the operator's /metrics holds once it has reconciled a policy (its handlers publish the pod
    counts as tests/operator/test_operator_kmock.py shows)."""
    from kvpool_operator import metrics
    from prometheus_client import generate_latest

    metrics.publish("llm", "exported-names", {"targetPods": 2, "syncedPods": 1, "misboundPods": 1})
    try:
        return sample_names(generate_latest(metrics.REGISTRY).decode())
    finally:
        metrics.forget("llm", "exported-names")


def test_dashboard_and_rules_query_only_exported_metrics():
    """Every metric a panel or a rule queries is one the sidecar or the operator exports, and
    every job a rule names is one the PodMonitors scrape."""
    dashboard = json.loads((MANIFESTS / "monitoring" / "dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    exprs += [r["expr"] for g in rule_groups()["groups"] for r in g["rules"]]
    recorded = {r["record"] for g in rule_groups()["groups"] for r in g["rules"] if "record" in r}
    used = {m for e in exprs for m in re.findall(r"\b(kvpool_[a-z_]+|kvpool:[a-z0-9_:]+)", e)}
    exported = exported_metric_names()
    missing = {m for m in used if m not in exported and m not in recorded}
    assert not missing, f"queried but not exported: {sorted(missing)}"
    assert {"kvpool_hit_tokens_total", "kvpool_reuse_decay_per_minute", "kvpool_pages",
            "kvpool_config_reloads_total", "kvpool_operator_policy_target_pods",
            "kvpool_operator_policy_synced_pods", "kvpool_operator_reconcile_errors_total"} <= used
    jobs = {job for e in exprs for job in re.findall(r'\bjob="([^"]+)"', e)}
    assert jobs == {"kvpool-sidecar", "kvpool-operator"} and jobs <= set(scraped_containers().values())


def dashboard() -> dict:
    return json.loads((MANIFESTS / "monitoring" / "dashboard.json").read_text())


# Each sidecar series a panel reads is filtered by the namespace and pod variables, and joined to the pods
# whose sidecar runs the policies chosen (kvpool_config_info's `source`, one series a pod).
PANEL_FILTER = '{namespace=~"$namespace", pod=~"$pod"}'
POLICY_JOIN = ('* on (namespace, pod) group_left () max by (namespace, pod) '
               '(kvpool_config_info{namespace=~"$namespace", pod=~"$pod", source=~"$policy"})')


def test_every_dashboard_panel_follows_the_namespace_pod_and_policy_variables():
    from kvpool_sidecar.service.metrics import SidecarMetrics

    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    label_values = r"label_values\((kvpool_[a-z_]+)(\{.*\})?, ([a-z_]+)\)"
    queried = {n: re.fullmatch(label_values, variables[n]["definition"]) for n in ("namespace", "policy", "pod")}
    assert all(queried.values()), {n: variables[n]["definition"] for n in queried}
    assert {n: m.group(3) for n, m in queried.items()} == {"namespace": "namespace", "policy": "source", "pod": "pod"}
    # namespace and pod: what the PodMonitor's targets carry; source: the sidecar's own label
    assert "source" in SidecarMetrics().config_info._labelnames
    for name, variable in variables.items():
        if variable["type"] == "query":
            assert variable["query"]["query"] == variable["definition"], name
            assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*", name
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            series = [m for m in re.finditer(r"\bkvpool_[a-z_]+\b", expr) if m.group() != "kvpool_config_info"]
            assert series, panel["title"]
            for m in series:
                after = expr[m.end():]
                assert after.startswith(PANEL_FILTER), f"{panel['title']}: {m.group()} not filtered by namespace, pod"
                after = re.sub(r"^\[\w+\]\)", "", after.removeprefix(PANEL_FILTER))  # rate(...[5m])
                assert after.startswith(" " + POLICY_JOIN), f"{panel['title']}: {m.group()} not joined to $policy"


@needs_promtool
def test_a_panel_chosen_by_policy_counts_only_that_policys_pods(tmp_path):
    """Prometheus itself evaluates two panels, with the variables as Grafana expands them: policy llm/chat
    chosen, the pod of llm/batch beside it is left out of both a sum and a ratio."""
    panels = {p["title"]: p["targets"][0]["expr"] for p in dashboard()["panels"]}
    chosen = {"$namespace": ".*", "$pod": ".*", "$policy": "llm/chat"}

    def expand(expr: str) -> str:
        for name, value in chosen.items():
            expr = expr.replace(name, value)
        return expr

    target = 'job="kvpool-sidecar", namespace="llm", container="kvpool-sidecar"'
    series = []
    for pod, source, cached, hits in (("a", "llm/chat", 10, 1), ("b", "llm/batch", 100, 0)):
        labels = f'{target}, pod="{pod}"'
        series += [
            {"series": f'kvpool_config_info{{{labels}, hash="h{pod}", policy="lru", source="{source}"}}',
             "values": "1x10"},
            {"series": f'kvpool_pages{{{labels}, state="cached"}}', "values": f"{cached}x10"},
            {"series": f'kvpool_hit_tokens_total{{{labels}, workload_class="toC", region="prefix"}}',
             "values": f"0+{hits * 60}x10"},
            {"series": f'kvpool_lookup_tokens_total{{{labels}, workload_class="toC", region="prefix"}}',
             "values": "0+120x10"},
        ]
    tests = {"rule_files": [], "evaluation_interval": "1m", "tests": [{"interval": "1m", "input_series": series,
             "promql_expr_test": [
                 {"expr": expand(panels["Pages by state"]), "eval_time": "5m",
                  "exp_samples": [{"labels": '{state="cached"}', "value": 10}]},
                 {"expr": expand(panels["Token hit ratio by class"]), "eval_time": "5m",
                  "exp_samples": [{"labels": '{workload_class="toC"}', "value": 0.5}]},
             ]}]}
    (tmp_path / "panels_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run(["promtool", "test", "rules", "panels_test.yaml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_container_args_are_flags_the_cli_accepts():
    from kvpool_sidecar.cli import build_parser

    checked = 0
    for _, doc in documents():
        if doc["kind"] != "Deployment":
            continue
        for container in all_containers(doc["spec"]["template"]["spec"]):
            if "kvpool-sidecar" in container["image"]:
                args = build_parser().parse_args(container["args"])  # exits (SystemExit) on an unknown flag
                assert args.command == "serve"
                checked += 1
    assert checked == 1  # the inference pod's sidecar


def test_the_engine_is_wired_to_its_sidecar():
    """The GPU example's vLLM offloads through its own OffloadingConnector with TieringOffloadingSpec, and
    vLLM's factories resolve the spec and kvpool's tier from that very --kv-transfer-config; the tier points
    at the sidecar's socket, its chunks are the policy's pages, vLLM's primary tier is the size `plan`
    prints, and both containers see the shared memory that holds the pool and that tier."""
    from kvpool_sidecar.cli import build_parser
    from kvpool_sidecar.engines.settings import parse_tier_settings
    from kvpool_sidecar.engines.tier import KVPoolTier
    from kvpool_sidecar.replay.plan import primary_tier_bytes
    from kvpool_sidecar.service.server import parse_shape
    from kvpool_sidecar.storage import memory
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    docs = {doc["kind"]: doc for path, doc in documents() if path.name in ("inference.yaml", "policy.yaml")}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    engine = next(c for c in all_containers(pod) if c["name"] == "vllm")
    sidecar = next(c for c in all_containers(pod) if c["name"] == "kvpool-sidecar")
    args = engine["args"]
    transfer = KVTransferConfig(**json.loads(args[args.index("--kv-transfer-config") + 1]))
    assert KVConnectorFactory.get_connector_class(transfer).__name__ == "OffloadingConnector"
    assert transfer.kv_role == "kv_both" and transfer.kv_load_failure_policy == "recompute"
    extra = transfer.kv_connector_extra_config
    assert OffloadingSpecFactory.get_spec_cls(extra) is TieringOffloadingSpec
    [tier] = extra["secondary_tiers"]
    assert SecondaryTierFactory.get_tier_class(tier) is KVPoolTier
    settings = parse_tier_settings({k: v for k, v in tier.items() if k not in ("type", "module_path")}, "tier")
    served = build_parser().parse_args(sidecar["args"])
    assert settings.socket == served.engine_socket
    page_size = docs["KVCachePolicy"]["spec"]["pageSize"]
    assert extra["block_size"] == page_size == int(args[args.index("--block-size") + 1])  # a chunk is a page
    shape = parse_shape(served.kv_shape)
    max_model_len = 32768  # Qwen2.5-7B-Instruct's, which the example serves
    primary = primary_tier_bytes(shape.bytes_per_page(page_size), page_size, max_model_len, 8192)
    assert extra["cpu_bytes_to_use"] == primary
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in (engine, sidecar):
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
        run = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(settings.socket).parent))
        assert "emptyDir" in volumes[run["name"]]  # both containers see the engine channel's socket
        # One non-root user for both: the segment (0600) and the socket (0660) are theirs, no root needed.
        effective = pod["securityContext"] | container.get("securityContext", {})
        assert effective["runAsNonRoot"] and effective["runAsUser"] == pod["securityContext"]["runAsUser"] != 0
    segment = memory.segment_bytes(shape.bytes_per_page(page_size), served.pages)
    limit = volumes[shm["name"]]["emptyDir"]["sizeLimit"]
    assert segment + primary <= int(limit.removesuffix("Gi")) * 2**30  # the pool and vLLM's tier fit


def secret_behind(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at ``path`` in ``container``, through its mounts and volumes."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        directory = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(directory):
            secret = volumes[mount["name"]]["secret"]
            name = path.removeprefix(directory)
            items = secret.get("items", [{"key": name, "path": name}])
            key = next(item["key"] for item in items if item["path"] == name)
            return secret["secretName"], key
    raise AssertionError(f"{container['name']}: nothing mounted at {path}")


def test_the_secrets_are_wired_as_the_threat_model_says(tmp_path):
    """The sidecar's API, beyond loopback, needs tokens; the engine presents the `engine` one from the same
    Secret; peers prove the cluster key. The Secrets made by
    the commands in inference.yaml's header are files the CLI accepts, with the roles each reader needs."""
    from kvpool_sidecar.cli import build_parser
    from kvpool_sidecar.engines.settings import parse_tier_settings
    from kvpool_sidecar.peers.keys import TransferKeys
    from kvpool_sidecar.service.credentials import Credentials

    deployments = {doc["metadata"]["name"]: doc["spec"]["template"]["spec"]
                   for _, doc in documents() if doc["kind"] == "Deployment"}
    pod = deployments["qwen-chat"]
    engine = next(c for c in all_containers(pod) if c["name"] == "vllm")
    sidecar = next(c for c in all_containers(pod) if c["name"] == "kvpool-sidecar")
    served = build_parser().parse_args(sidecar["args"])
    transfer = json.loads(engine["args"][engine["args"].index("--kv-transfer-config") + 1])
    [tier] = transfer["kv_connector_extra_config"]["secondary_tiers"]
    tier = {k: v for k, v in tier.items() if k not in ("type", "module_path")}
    settings = parse_tier_settings(tier | {"token_file": None}, "tier")
    assert settings.socket.startswith("/run/kvpool/")  # the engine talks to its sidecar on a pod-local socket
    assert served.host == "0.0.0.0" and served.token_file and served.transfer_key_file
    wired = {
        "sidecar tokens": secret_behind(pod, sidecar, served.token_file),
        "engine token": secret_behind(pod, engine, tier["token_file"]),
        "transfer keys": secret_behind(pod, sidecar, served.transfer_key_file),
    }
    assert wired == {"sidecar tokens": ("kvpool-sidecar-tokens", "tokens"),
                     "engine token": ("kvpool-sidecar-tokens", "engine"),
                     "transfer keys": ("kvpool-transfer-keys", "keys")}
    # Run the header's commands with kubectl replaced by writing each literal to a file.
    header = [line.removeprefix("#").strip() for line in (MANIFESTS / "examples" / "inference.yaml").read_text()
              .splitlines() if line.startswith("#   ")]
    script = "\n".join(header).replace("\\\n", " ")
    fake_kubectl = tmp_path / "kubectl"
    fake_kubectl.write_text('#!/bin/bash\nname=$6; shift 6\nfor kv in "$@"; do kv=${kv#--from-literal=}; '
                            'mkdir -p "$OUT/$name"; printf "%s" "${kv#*=}" > "$OUT/$name/${kv%%=*}"; done\n')
    fake_kubectl.chmod(0o755)
    subprocess.run(["bash", "-ec", script], check=True, env={"PATH": f"{tmp_path}:/usr/bin:/bin", "OUT": str(tmp_path)})
    credentials = Credentials.parse((tmp_path / "kvpool-sidecar-tokens" / "tokens").read_text())
    engine_token = (tmp_path / "kvpool-sidecar-tokens" / "engine").read_text()
    assert credentials.who(engine_token).role == "engine"  # the engine channel and mapping the pool
    assert TransferKeys.load(tmp_path / "kvpool-transfer-keys" / "keys").signing[0] == "k1"


def test_the_example_sidecars_follow_their_policys_pods_as_peers_with_a_role_that_lists_pods():
    """--peers kubernetes on a declared peer port, under a service account whose Role lists the pods of the
    Deployment's namespace, and nothing more."""
    from kvpool_sidecar.cli import build_parser

    deploy = next(d for _, d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "qwen-chat")
    namespace, pod = deploy["metadata"]["namespace"], deploy["spec"]["template"]["spec"]
    sidecar = next(c for c in all_containers(pod) if c["name"] == "kvpool-sidecar")
    served = build_parser().parse_args(sidecar["args"])
    assert served.peers == "kubernetes" and served.transfer_key_file
    assert {"name": "peers", "containerPort": served.peer_port} in sidecar["ports"]
    account = pod["serviceAccountName"]
    docs = [d for _, d in documents()]
    assert any(d["kind"] == "ServiceAccount" and d["metadata"] == d["metadata"] | {"name": account,
               "namespace": namespace} for d in docs)
    [binding] = [d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == namespace
                 and {"kind": "ServiceAccount", "name": account, "namespace": namespace} in d["subjects"]]
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == binding["roleRef"]["name"]
              and d["metadata"]["namespace"] == namespace]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]


def pod_monitors() -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == "PodMonitor"]


def scraped_containers() -> dict[tuple[str, str], str]:
    """What the PodMonitors make Prometheus scrape, as the Prometheus Operator builds it: each endpoint
    takes the container ports of its name in the pods that its monitor's selector matches, in the
    namespaces the monitor covers (its own when it names none), with the job its relabelings set (else
    namespace/name of the monitor). (Deployment, container) -> job."""
    from kvpool_sidecar.config import LabelSelector

    out = {}
    for _, doc in documents():
        if doc["kind"] != "Deployment":
            continue
        template, namespace = doc["spec"]["template"], doc["metadata"]["namespace"]
        for monitor in pod_monitors():
            covered = monitor["spec"].get("namespaceSelector") or {}
            if not covered.get("any") and namespace not in covered.get("matchNames",
                                                                       [monitor["metadata"]["namespace"]]):
                continue
            if not LabelSelector.model_validate(monitor["spec"]["selector"]).matches(template["metadata"]["labels"]):
                continue
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                job = next((r["replacement"] for r in endpoint.get("relabelings", []) if r["targetLabel"] == "job"),
                           f"{monitor['metadata']['namespace']}/{monitor['metadata']['name']}")
                for container in all_containers(template["spec"]):
                    if endpoint["port"] in {p["name"] for p in container.get("ports", [])}:
                        out[(doc["metadata"]["name"], container["name"])] = job
    return out


def test_the_pod_monitor_scrapes_every_kvpool_container():
    """The PodMonitors (custom resources, skipped by the schema check above) select kvpool's own label,
    not any pod with an `app` label: each kvpool container (the inference pod's sidecar, the operator) is
    scraped under its own job, on a named port where it serves /metrics beyond loopback,
    and nothing else is: not the Inference Extension's picker, whose port is also named `metrics`."""
    from kvpool_operator.cli import build_parser as operator_parser
    from kvpool_sidecar.cli import build_parser
    from kvpool_sidecar.config import LabelSelector

    assert scraped_containers() == {("qwen-chat", "kvpool-sidecar"): "kvpool-sidecar",
                                    ("kvpool-operator", "operator"): "kvpool-operator"}
    for monitor in pod_monitors():
        selector = LabelSelector.model_validate(monitor["spec"]["selector"])
        assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/part-of"] == "kvpool"
        assert not selector.matches({"app": "postgres"})  # someone else's pod in a namespace it covers
    sidecars = next(m for m in pod_monitors() if m["metadata"]["name"] == "kvpool-sidecars")
    assert sidecars["spec"]["namespaceSelector"] == {"any": True}  # inference pods in any namespace
    deployments = {d["metadata"]["name"]: d["spec"]["template"]["spec"] for _, d in documents()
                   if d["kind"] == "Deployment"}
    endpoints = {e["port"]: e for m in pod_monitors() for e in m["spec"]["podMetricsEndpoints"]}
    for deployment, name in scraped_containers():
        container = next(c for c in all_containers(deployments[deployment]) if c["name"] == name)
        if "kvpool-operator" in container["image"]:
            args = operator_parser().parse_args(container["args"])
            host, port = args.metrics_host, args.metrics_port
        else:
            args = build_parser().parse_args(container["args"])
            host, port = args.metrics_host, args.metrics_port
        named = {p["containerPort"]: p["name"] for p in container["ports"]}
        assert host == "0.0.0.0" and endpoints[named[port]]["path"] == "/metrics", (deployment, host, port)


# The InferencePool's schema as published by the Gateway API Inference Extension (inference.networking.k8s.io/v1,
# its API reference and CRD): written down here because no cluster (and no CRD) is at hand.
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "object", "required": ["number"], "additionalProperties": False,
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object", "required": ["matchLabels"], "additionalProperties": False,
                    "properties": {"matchLabels": {
                        "type": "object", "minProperties": 1,
                        "additionalProperties": {"type": "string", "maxLength": 63,
                                                 "pattern": "^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}},
                },
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                },
            },
        },
    },
}


def pool_documents() -> dict[str, dict]:
    return {doc["kind"]: doc for _, doc in documents() if _.name == "inference-pool.yaml"}


def test_the_inference_pool_validates_against_its_published_schema():
    import jsonschema

    pool = pool_documents()["InferencePool"]
    jsonschema.validate(pool, INFERENCE_POOL_V1)
    broken = json.loads(json.dumps(pool))
    broken["spec"]["endpointPickerRef"]["failureMode"] = "Retry"
    with pytest.raises(jsonschema.ValidationError):  # the schema can fail
        jsonschema.validate(broken, INFERENCE_POOL_V1)


def test_the_inference_pool_and_its_router_count_kvpools_tier():
    """The pool selects the engine pods on the engine's port and names the picker's Service; the picker
    reads each pod's KV event port with the engine's block size and weighs the tier kvpool's events name
    (medium CPU) below the GPU's; the engine publishes those events, kvpool's pages among them (its
    offloading tiers' events, KVPoolTier's with them, while vLLM's KV events are on)."""
    pool = pool_documents()
    spec = pool["InferencePool"]["spec"]
    deployments = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "Deployment"}
    services = {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == "Service"}
    engine_pod = deployments["qwen-chat"]["spec"]["template"]
    engine = next(c for c in engine_pod["spec"]["containers"] if c["name"] == "vllm")
    assert spec["selector"]["matchLabels"].items() <= engine_pod["metadata"]["labels"].items()
    ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
    pod_ports = {p["name"]: p["containerPort"] for c in all_containers(engine_pod["spec"]) for p in c.get("ports", [])}
    assert [p["number"] for p in spec["targetPorts"]] == [pod_ports["http"]]  # the routing proxy's: below
    picker = services[spec["endpointPickerRef"]["name"]]
    assert spec["endpointPickerRef"]["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    epp_pod = deployments[spec["endpointPickerRef"]["name"]]["spec"]["template"]
    assert picker["spec"]["selector"].items() <= epp_pod["metadata"]["labels"].items()

    args = engine["args"]
    events = json.loads(args[args.index("--kv-events-config") + 1])
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert [t["type"] for t in transfer["kv_connector_extra_config"]["secondary_tiers"]] == ["KVPoolTier"]
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    assert events["endpoint"] == f"tcp://*:{ports['kv-events']}"  # each pod binds; the picker subscribes
    assert "$(POD_IP)" in events["topic"] and any(e["name"] == "POD_IP" for e in engine["env"])
    # The topic names the pod as the router knows it: its address and the pool's port.
    assert events["topic"] == f"kv@$(POD_IP):{pod_ports['http']}@{args[args.index('--model') + 1]}"

    config = yaml.safe_load(pool["ConfigMap"]["data"]["epp.yaml"])
    picker_containers = {c["name"]: c for c in epp_pod["spec"]["containers"]}
    mounted = picker_containers["epp"]["args"]
    assert mounted[mounted.index("--config-file") + 1] == "/config/epp.yaml"
    assert mounted[mounted.index("--pool-name") + 1] == pool["InferencePool"]["metadata"]["name"]
    scorer = next(p for p in config["plugins"] if p["type"] == "precise-prefix-cache-scorer")["parameters"]
    assert scorer["tokenProcessorConfig"]["blockSizeTokens"] == int(args[args.index("--block-size") + 1])
    discovery = scorer["kvEventsConfig"]["podDiscoveryConfig"]
    assert scorer["kvEventsConfig"]["discoverPods"] and discovery["socketPort"] == ports["kv-events"]
    assert events["topic"].startswith(scorer["kvEventsConfig"]["topicFilter"])
    # The pods it subscribes to are the pool's: the endpoint-notification-source hands each to the scorer.
    assert {"pluginRef": "endpoint-notification-source", "extractors": [{"pluginRef": "precise-prefix-cache-scorer"}]} \
        in config["dataLayer"]["sources"]
    # It tokenizes as the engine does: vLLM's renderer of the served model, in the picker's pod, on loopback.
    [tokens] = [p["parameters"] for p in config["plugins"] if p["type"] == "token-producer"]
    model = args[args.index("--model") + 1]
    render = picker_containers["render"]
    assert render["command"][0] == "vllm"
    rendered = _vllm_launch_parser().parse_args([*render["command"][1:], *render["args"]])
    assert rendered.launch_component == "render" and rendered.model_tag == tokens["modelName"] == model
    assert tokens["vllm"]["url"] == f"http://localhost:{rendered.port}" and rendered.host == "127.0.0.1"
    assert rendered.port not in [p["containerPort"] for c in epp_pod["spec"]["containers"] for p in c.get("ports", [])]
    tiers = {t["name"]: t["weight"] for t in scorer["indexerConfig"]["kvCacheBackendConfigs"]}
    assert 0 < tiers["cpu"] < tiers["gpu"]  # "cpu": vLLM's medium "CPU", the one kvpool's events carry
    used = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert "precise-prefix-cache-scorer" in used and used <= {p["type"] for p in config["plugins"]}


def _vllm_launch_parser():
    """vLLM's own parser of `vllm launch ...` (the version the example's images run): unknown flags exit."""
    from vllm.entrypoints.cli.launch import LaunchSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    LaunchSubcommand().subparser_init(parser.add_subparsers(required=True, dest="subparser"))
    return parser


# llm-d-router v0.10.0 (the picker image inference-pool.yaml runs), written down from its sources because no
# image is at hand: it decodes its EndpointPickerConfig and every plugin's parameters strictly (an unknown
# field is a start-up error, and so is a config too old for it), names an unnamed plugin by its type, and
# refuses an Alpha plugin unless started with --allow-experimental-plugins. Each plugin type the example uses,
# with its stability and the parameters the example may give it.
ROUTER_IMAGE = "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
ROUTER_FLAGS = {"--pool-name", "--pool-namespace", "--pool-group", "--config-file", "--config-text", "--grpc-port",
                "--grpc-health-port", "--metrics-port", "--secure-serving", "--allow-experimental-plugins"}


def _strict(properties: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": properties, "additionalProperties": False, "required": list(required)}


_ANY_OBJECT = {"type": "object"}
ROUTER_PLUGINS = {
    "single-profile-handler": ("Beta", _strict({})),
    "endpoint-notification-source": ("Beta", _strict({})),
    "kv-cache-utilization-scorer": ("Beta", _strict({})),
    "queue-scorer": ("Beta", _strict({})),
    "max-score-picker": ("Beta", _strict({})),
    "token-producer": ("Beta", _strict({
        "modelName": {"type": "string"},
        "vllm": _strict({"url": {"type": "string"}, "timeout": {"type": "string"}, "mmTimeout": {"type": "string"}}),
        "udsTokenizerConfig": _ANY_OBJECT, "estimate": _ANY_OBJECT})),
    "precise-prefix-cache-scorer": ("Beta", _strict({
        "tokenProcessorConfig": _strict({"blockSize": {"type": "integer"}, "blockSizeTokens": {"type": "integer"},
                                         "hashSeed": {"type": "string"}}),
        "indexerConfig": _strict({
            "kvBlockIndexConfig": _ANY_OBJECT, "tokenizersPoolConfig": _ANY_OBJECT,
            "kvCacheBackendConfigs": {"type": "array", "items": _strict(
                {"name": {"type": "string"}, "weight": {"type": "number"}}, ("name", "weight"))}}),
        "kvEventsConfig": _strict({
            "zmqEndpoint": {"type": "string"}, "topicFilter": {"type": "string"},
            "concurrency": {"type": "integer"}, "engineType": {"enum": ["vllm", "sglang"]},
            "discoverPods": {"type": "boolean"},
            "podDiscoveryConfig": _strict({"podLabelSelector": {"type": "string"}, "podNamespace": {"type": "string"},
                                           "socketPort": {"type": "integer"},
                                           "replaySocketPort": {"type": "integer"}})}),
        "speculativeIndexing": {"type": "boolean"}, "speculativeTTL": {"type": "string"}})),
    "p2p-source-producer": ("Alpha", _strict({
        "prefixMatchInfoProducerName": {"type": "string"}, "minCachedTokenDelta": {"type": "integer", "minimum": 1},
        "prefillProfileName": {"type": "string"}})),
}
_REF = _strict({"pluginRef": {"type": "string"}}, ("pluginRef",))
ROUTER_CONFIG = _strict({
    "apiVersion": {"enum": ["llm-d.ai/v1alpha1", "inference.networking.x-k8s.io/v1alpha1"]},  # the second deprecated
    "kind": {"const": "EndpointPickerConfig"},
    "plugins": {"type": "array", "items": _strict(
        {"type": {"enum": sorted(ROUTER_PLUGINS)}, "name": {"type": "string"}, "parameters": _ANY_OBJECT}, ("type",))},
    "schedulingProfiles": {"type": "array", "minItems": 1, "items": _strict(
        {"name": {"type": "string"}, "plugins": {"type": "array", "items": _strict(
            {"pluginRef": {"type": "string"}, "weight": {"type": "number"}}, ("pluginRef",))}}, ("name", "plugins"))},
    "dataLayer": _strict({"injectDefaults": {"type": "boolean"}, "sources": {"type": "array", "items": _strict(
        {"pluginRef": {"type": "string"}, "extractors": {"type": "array", "items": _REF}}, ("pluginRef",))}}),
}, ("apiVersion", "kind", "plugins"))


def router_config() -> tuple[dict, dict]:
    """The picker's config, and its plugins by name (a plugin without one is named by its type)."""
    config = yaml.safe_load(pool_documents()["ConfigMap"]["data"]["epp.yaml"])
    return config, {p.get("name", p["type"]): p for p in config["plugins"]}


def test_the_router_loads_its_config_as_llm_d_router_decodes_it():
    """Every field is one the pinned router decodes, every plugin's parameters are its own, every reference
    names a configured plugin, and the picker runs that router with the flags its plugins need."""
    import jsonschema

    config, plugins = router_config()
    jsonschema.validate(config, ROUTER_CONFIG)
    assert len(plugins) == len(config["plugins"])  # no two plugins of one name
    for plugin in config["plugins"]:
        jsonschema.validate(plugin.get("parameters", {}), ROUTER_PLUGINS[plugin["type"]][1])
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    refs += [r["pluginRef"] for src in config["dataLayer"]["sources"] for r in [src, *src["extractors"]]]
    assert set(refs) <= set(plugins)
    deploy = next(d for _, d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "qwen-chat-epp")
    [epp] = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "epp"]
    assert epp["image"] == ROUTER_IMAGE
    assert {a for a in epp["args"] if a.startswith("--")} <= ROUTER_FLAGS
    alpha = [name for name, p in plugins.items() if ROUTER_PLUGINS[p["type"]][0] == "Alpha"]
    assert ("--allow-experimental-plugins" in epp["args"]) == bool(alpha), alpha
    with pytest.raises(jsonschema.ValidationError):  # the schemas can fail: a field the scorer does not have
        jsonschema.validate({"blockSize": 16}, ROUTER_PLUGINS["precise-prefix-cache-scorer"][1])


# llm-d's routing sidecar (llm-d-router v0.10.0's disagg sidecar, the image inference.yaml runs), written down
# from its sources: its flags (an unknown one stops it), and what it does with the router's source header
# when started with --kv-connector=offloading and sent no prefill header: the request's kv_transfer_params
# become {"remote_kv_source": {remote_host: the header's host, remote_port: its own --p2p-connector-port,
# kv_request_id: a fresh UUID}} (its decodeWithP2PSource), unless the header names the proxy itself (POD_IP,
# --port).
ROUTING_PROXY_IMAGE = "ghcr.io/llm-d/llm-d-router-disagg-sidecar:v0.10.0"
ROUTING_PROXY_FLAGS = {
    "port", "model-server-port", "vllm-port", "data-parallel-size", "kv-connector", "ec-connector",
    "mooncake-bootstrap-port", "p2p-connector-port", "enable-p2p-pull", "enable-ssrf-protection",
    "enable-prefiller-sampling", "enable-tls", "tls-insecure-skip-verify", "secure-proxy", "cert-path",
    "inference-pool", "pool-group", "max-idle-conns-per-host", "prefill-max-retries", "prefill-retry-backoff",
    "decode-chunk-size", "configuration", "configuration-file", "tracing", "metrics-port"}


def routing_proxy_flags(container: dict) -> dict[str, str]:
    """The routing proxy's flags (the example writes each as --name=value), each one it has."""
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    assert len(flags) == len(container["args"]) and set(flags) <= ROUTING_PROXY_FLAGS, container["args"]
    return flags


def routing_proxy_params(flags: dict[str, str], pod_ip: str, header: str | None, params: dict) -> dict:
    """The kv_transfer_params the routing proxy passes vLLM for a request with ``params`` and the router's
    source header (None: no header)."""
    if header is None or flags.get("kv-connector") != "offloading" or header == f"{pod_ip}:{flags['port']}":
        return params
    host = header.rsplit(":", 1)[0]
    return {"remote_kv_source": {"kv_request_id": "6f1c0e1e-2d9a-4c55-9d1e-7d0b8b1f6a10", "remote_host": host,
                                 "remote_port": int(flags["p2p-connector-port"])}}


def test_the_router_names_a_source_pod_and_the_routing_proxy_hints_its_kvpool_peer_port():
    """llm-d's P2P source producer reads the precise scorer's match data and writes a source pod's address and
    the pool's port; the pool's port reaches the routing proxy, which turns that into the hint naming the
    source's kvpool peer port, a member of the receiving sidecar's policy; vLLM listens where the proxy
    forwards; no two containers of the pod claim one port, and each declares the ports it listens on."""
    from kvpool_sidecar.cli import build_parser
    from kvpool_sidecar.engines.hints import peer_source
    from kvpool_sidecar.service.membership import peer_members

    config, plugins = router_config()
    [producer] = [p["parameters"] for p in config["plugins"] if p["type"] == "p2p-source-producer"]
    matched = plugins[producer["prefixMatchInfoProducerName"]]  # "" would be the approximate producer's
    assert matched["type"] in {"precise-prefix-cache-scorer", "precise-prefix-cache-producer"}
    profiles = config["schedulingProfiles"]
    assert producer["prefillProfileName"] in [prof["name"] for prof in profiles]
    assert "p2p-source-producer" not in [p["pluginRef"] for prof in profiles for p in prof["plugins"]]
    docs = {doc["kind"]: doc for path, doc in documents() if path.name in ("inference.yaml", "policy.yaml")}
    page_size = docs["KVCachePolicy"]["spec"]["pageSize"]
    assert matched["parameters"]["tokenProcessorConfig"]["blockSizeTokens"] == page_size
    assert producer["minCachedTokenDelta"] % page_size == 0 and producer["minCachedTokenDelta"] >= page_size

    template = docs["Deployment"]["spec"]["template"]
    pod = template["spec"]
    containers = {c["name"]: c for c in all_containers(pod)}
    proxy, engine, sidecar = containers["routing-proxy"], containers["vllm"], containers["kvpool-sidecar"]
    assert proxy["image"] == ROUTING_PROXY_IMAGE and proxy in pod["initContainers"]
    assert proxy["restartPolicy"] == "Always"  # starts before vLLM, stops after it
    flags = routing_proxy_flags(proxy)
    served = build_parser().parse_args(sidecar["args"])
    assert flags["kv-connector"] == "offloading" and flags["secure-proxy"] == "false"
    assert int(flags["p2p-connector-port"]) == served.peer_port
    assert {"name": "peers", "containerPort": served.peer_port} in sidecar["ports"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in proxy["env"]
    args = engine["args"]
    vllm_port = int(args[args.index("--port") + 1])
    assert int(flags["model-server-port"]) == vllm_port
    assert {"name": "engine", "containerPort": vllm_port} in engine["ports"]
    assert {engine[probe]["httpGet"]["port"] for probe in ("startupProbe", "livenessProbe", "readinessProbe")} \
        == {"engine"}  # vLLM's own health, not the proxy's
    # The Service and the InferencePool reach the proxy.
    named = {p["name"]: (c["name"], p["containerPort"]) for c in all_containers(pod) for p in c.get("ports", [])}
    service = next(d for _, d in documents() if d["kind"] == "Service" and d["metadata"]["name"] == "qwen-chat")
    [http] = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert named[http["targetPort"]] == ("routing-proxy", int(flags["port"]))
    [target] = [p["number"] for p in pool_documents()["InferencePool"]["spec"]["targetPorts"]]
    assert target == int(flags["port"])
    # One port, one container; each container declares what it listens on.
    declared = [p["containerPort"] for c in all_containers(pod) for p in c.get("ports", [])]
    assert len(declared) == len(set(declared)), declared
    events = json.loads(args[args.index("--kv-events-config") + 1])
    listening = {"kvpool-sidecar": {served.port, served.metrics_port, served.peer_port},
                 "routing-proxy": {int(flags["port"])},
                 "vllm": {vllm_port, int(events["endpoint"].rsplit(":", 1)[1])}}
    assert {c["name"]: {p["containerPort"] for p in c["ports"]} for c in all_containers(pod)} == listening

    # A request the router sends to pod B while pod A's kvpool holds its prompt: the header names A at the
    # pool's port, B's proxy turns it into a hint at A's peer port, and B's sidecar takes A for a member.
    policy = docs["KVCachePolicy"]["metadata"]["name"]
    pods = [{"metadata": {"name": name, "labels": template["metadata"]["labels"]},
             "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}
            for name, ip in (("qwen-chat-a", "10.0.0.7"), ("qwen-chat-b", "10.0.0.8"))]
    members = peer_members(pods, policy, served.peer_port, own_pod="qwen-chat-b")
    hint = peer_source(routing_proxy_params(flags, "10.0.0.8", f"10.0.0.7:{target}", {"tenant": "t"}))
    assert hint is not None and (hint.host, hint.port) in members
    assert peer_source(routing_proxy_params(flags, "10.0.0.8", f"10.0.0.8:{target}", {})) is None  # B itself
    assert peer_source(routing_proxy_params(flags, "10.0.0.8", None, {})) is None


def _quantity(text: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for unit, size in units.items():
        if text.endswith(unit):
            return int(text.removesuffix(unit)) * size
    return int(text)


def sidecar_pods() -> list[tuple[dict, dict, object, int]]:
    """Every manifest container that runs the sidecar: (pod spec, container, its flags, its pool's page bytes)."""
    from kvpool_sidecar.cli import build_parser
    from kvpool_sidecar.service.server import parse_shape

    page_size = next(doc for _, doc in documents() if doc["kind"] == "KVCachePolicy")["spec"]["pageSize"]
    found = []
    for _, doc in documents():
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        for c in all_containers(pod):
            if c.get("args", [None])[0] == "serve":
                served = build_parser().parse_args(c["args"])
                if served.kv_shape:
                    found.append((pod, c, served, parse_shape(served.kv_shape).bytes_per_page(page_size)))
    assert found, "no manifest runs a sidecar with a pool"
    return found


def test_every_sidecar_container_has_the_memory_its_pool_needs_by_the_one_formula():
    """The sidecar allocates its pool's segment at start-up and is charged for it: its container's
    limit, and the memory volume holding the segment, follow storage/memory.py's formula, as
    `kvpool-sidecar plan` prints it in the manifest's header."""
    from kvpool_sidecar.storage import memory

    for pod, container, served, page_bytes in sidecar_pods():
        segment = memory.segment_bytes(page_bytes, served.pages)
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert _quantity(limits["memory"]) >= memory.sidecar_memory_bytes(segment, served.pages)
        assert _quantity(requests["memory"]) == _quantity(limits["memory"])  # never overcommitted on the node
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        assert _quantity(volumes[shm["name"]]["emptyDir"]["sizeLimit"]) >= segment
    # The header's plan command prints the flags and sizes the example uses.
    header = (MANIFESTS / "examples" / "inference.yaml").read_text()
    command = re.search(r"#  \$ (kvpool-sidecar plan .*)\n", header)
    assert command is not None
    sidecar_bin = str(Path(subprocess.os.sys.executable).with_name("kvpool-sidecar"))
    out = subprocess.run([sidecar_bin, *command.group(1).split()[1:]], capture_output=True, text=True, check=True)
    pod, container, served, _ = sidecar_pods()[0]
    assert f"--pages {served.pages} " in out.stdout
    assert f"sidecar container memory limit >= {container['resources']['limits']['memory']}" in out.stdout
    size = next(v for v in pod["volumes"] if v["name"] == "kvpool-shm")["emptyDir"]["sizeLimit"]
    assert f"memory volume sizeLimit >= {size}" in out.stdout


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    import sys
    import time

    from support import free_port

    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).with_name("kvpool-sidecar")), "serve", *args, "--port", str(port),
                             "--engine-socket", "none", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/healthz", timeout=0.5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    return proc, url


def _touched(proc: subprocess.Popen, url: str) -> int:
    """What the sidecar process is charged for now: its resident memory and its segment's allocated pages."""
    name = httpx.get(url + "/v1/storage/handle", timeout=5).json()["name"]
    status = Path(f"/proc/{proc.pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
    return rss + Path("/dev/shm", name).stat().st_blocks * 512


def test_the_example_sidecar_started_scaled_down_fits_its_limit_scaled_up():
    """The example's sidecar, its own arguments at 1/512 and 1/128 of its pages: what start-up touches
    grows linearly with the pages; extended to the example's pages it fits the container's limit with
    the formula's headroom to spare."""
    from kvpool_sidecar.storage import memory

    _, container, served, _ = sidecar_pods()[0]
    keep = {"--kv-shape": served.kv_shape}
    points = []
    for scale in (512, 128):
        pages = served.pages // scale
        args = [a for k, v in keep.items() for a in (k, v)] + ["--pages", str(pages)]
        proc, url = _start(args)
        try:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            points.append((pages, _touched(proc, url)))
        finally:
            proc.terminate()
            proc.wait(30)
    (p1, t1), (p2, t2) = points
    per_page = (t2 - t1) / (p2 - p1)
    at_full = t2 + per_page * (served.pages - p2)
    limit = _quantity(container["resources"]["limits"]["memory"])
    assert at_full * (1 + memory.HEADROOM) <= limit, (at_full / 2**30, limit / 2**30)


def test_a_pool_larger_than_its_shm_mount_is_refused_at_start_naming_the_sizes():
    import os

    # More pages than the whole mount holds (not just what is free now: another process freeing memory in
    # between must not let a pool of the machine's size start).
    size = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize
    pages = size // (2 * 2 * 64 * 4 * 32) + 1024  # the tiny model's pages, a thousand more than fit
    proc, _ = _start(["--kv-shape", "2,2,64,float32", "--pages", str(pages)])
    try:
        proc.wait(60)
    finally:
        proc.kill()
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode != 0
    assert "of shared memory, and the shm mount has" in err and "GiB free" in err and "--pages" in err
    assert "Bus error" not in err and proc.returncode != -7  # not a SIGBUS


def test_the_inference_pod_starts_its_sidecar_first_stops_it_last_and_probes_cheap_endpoints():
    """The native-sidecar pattern (Kubernetes 1.29+): the sidecar is an init container that keeps running
    (restartPolicy Always), so it starts, its startupProbe passed, before vLLM and stops after it; its
    liveness is the lock-free /healthz, lenient (a failure is a SIGTERM), apart from readiness; vLLM has a
    preStop and a grace period to drain; a PDB and a topology spread keep replicas apart."""
    from kvpool_sidecar.cli import build_parser
    from kvpool_sidecar.service.app import create_app
    from kvpool_sidecar.service.state import Sidecar

    path = MANIFESTS / "examples" / "inference.yaml"
    docs = [d for p, d in documents() if p == path]
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    # kvpool's sidecar first (vLLM's tier needs it), then llm-d's routing proxy; both native sidecars.
    assert [c["name"] for c in pod["initContainers"]] == ["kvpool-sidecar", "routing-proxy"]
    assert {c["restartPolicy"] for c in pod["initContainers"]} == {"Always"}
    sidecar = pod["initContainers"][0]
    assert [c["name"] for c in pod["containers"]] == ["vllm"]
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    served = build_parser().parse_args(sidecar["args"])
    assert ports["api"] == served.port
    routes = {r.path for r in create_app(Sidecar(SidecarConfig(), 8)).routes}
    for probe, path_ in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert sidecar[probe]["httpGet"] == {"path": path_, "port": "api"} and path_ in routes
    liveness = sidecar["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60  # a minute of failures, not one
    startup = sidecar["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # allocating a large pool
    engine = pod["containers"][0]
    assert engine["lifecycle"]["preStop"] and pod["terminationGracePeriodSeconds"] >= 120
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= engine.keys()
    labels = deploy["spec"]["selector"]["matchLabels"]
    budget = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == labels and budget["spec"]["maxUnavailable"] == 1
    assert pod["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == labels


def test_liveness_answers_at_once_while_the_pool_is_too_busy_for_metrics():
    """/healthz takes no lock: while a pool call holds the pool (a large eviction, a takeover's wait),
    a scrape of /metrics waits for it, and the liveness probe still answers in milliseconds."""
    import statistics
    import threading

    with live_sidecar(pages=64) as (url, sidecar):
        busy, release = threading.Event(), threading.Event()

        def hold() -> None:
            with sidecar._mutex:
                busy.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert busy.wait(5)
        try:
            with pytest.raises(httpx.TimeoutException):
                httpx.get(url + "/metrics", timeout=1.0)  # what a /metrics liveness probe would get
            took = []
            for _ in range(20):
                start = time.perf_counter()
                assert httpx.get(url + "/healthz", timeout=1.0).status_code == 200
                took.append(time.perf_counter() - start)
            assert statistics.median(took) < 0.05, took
        finally:
            release.set()
            holder.join()
