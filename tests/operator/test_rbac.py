"""The operator's RBAC as shipped, in both modes, against the API calls it makes: no grant unused, none
missing.

The calls are derived, not listed by hand: the kubernetes client's from the operator's source (an explicit
table maps each client method to the grant it needs; a method the table lacks fails the test), kopf's from
how `kvpool-operator run` starts kopf (clusterwide or `--namespace`, peering, posting, scanning) and from
the resources its handlers are registered for, and the admission plugin's from the ConfigMap the operator
renders. The mode is what the manifests run: each kustomization rendered, its Deployment's arguments
given to the real CLI with `kopf.run` caught.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import jsonpatch
import kopf
import kubernetes
import pytest
import yaml
from kopf._cogs.structs import references
from kopf._core.intents import causes

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "manifests"
PACKAGE = ROOT / "operator" / "kvpool_operator"
MODES = {"clusterwide": MANIFESTS, "namespaced": MANIFESTS / "namespaced"}


class Grant(NamedTuple):
    namespace: str | None  # None: in every namespace, and cluster-scoped resources (a ClusterRoleBinding's)
    group: str
    resource: str
    verb: str

    def __str__(self) -> str:
        where = f"in namespace {self.namespace}" if self.namespace else "cluster-wide"
        return f"{self.verb} {self.resource} ({self.group or 'core'}) {where}"


class ClientCall(NamedTuple):
    group: str  # "{group}" and "{plural}": the custom-object methods' own arguments
    resource: str
    verb: str
    all_namespaces: bool = False


# The kubernetes client's methods the operator may call, and the grant each needs. A call to a client
# method not here fails test_every_client_call_the_operator_makes_has_its_grant_in_the_table.
CLIENT_METHODS: dict[str, ClientCall] = {
    "list_namespaced_pod": ClientCall("", "pods", "list"),
    "read_namespaced_pod": ClientCall("", "pods", "get"),
    "list_pod_for_all_namespaces": ClientCall("", "pods", "list", all_namespaces=True),
    "read_namespaced_config_map": ClientCall("", "configmaps", "get"),
    "list_namespaced_config_map": ClientCall("", "configmaps", "list"),
    "create_namespaced_config_map": ClientCall("", "configmaps", "create"),
    "patch_namespaced_config_map": ClientCall("", "configmaps", "patch"),
    "replace_namespaced_config_map": ClientCall("", "configmaps", "update"),
    "delete_namespaced_config_map": ClientCall("", "configmaps", "delete"),
    "create_namespaced_event": ClientCall("", "events", "create"),
    "get_namespaced_custom_object": ClientCall("{group}", "{plural}", "get"),
    "list_namespaced_custom_object": ClientCall("{group}", "{plural}", "list"),
    "list_cluster_custom_object": ClientCall("{group}", "{plural}", "list", all_namespaces=True),
    "patch_namespaced_custom_object": ClientCall("{group}", "{plural}", "patch"),
    "replace_namespaced_custom_object": ClientCall("{group}", "{plural}", "update"),
    "patch_namespaced_custom_object_status": ClientCall("{group}", "{plural}/status", "patch"),
    "replace_namespaced_custom_object_status": ClientCall("{group}", "{plural}/status", "update"),
}
# The kinds the operator writes with ownerReferences, as RBAC names them.
WRITTEN_KINDS = {"ConfigMap": ("", "configmaps")}


# --- the manifests -------------------------------------------------------------------------------


def render(directory: Path) -> list[dict]:
    """A kustomization's objects, as `kubectl kustomize` builds them for the features the manifests use
    (resources, inline JSON 6902 patches; test_render_matches_kustomize checks the two agree)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(spec) - {"apiVersion", "kind", "resources", "patches"}
    assert not unsupported, f"{directory}: render() does not know {sorted(unsupported)}: teach it"
    docs: list[dict] = []
    for entry in spec["resources"]:
        path = directory / entry
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in spec.get("patches", []):
        target = patch["target"]
        hits = [i for i, d in enumerate(docs) if (d["kind"], d["metadata"]["name"]) == (target["kind"], target["name"])]
        assert hits, f"{directory}: the patch's target {target} is not among its resources"
        for i in hits:
            docs[i] = jsonpatch.apply_patch(docs[i], yaml.safe_load(patch["patch"]))
    return docs


def operator_deployment(docs: list[dict]) -> dict:
    [deploy] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvpool-operator"]
    return deploy


def granted(docs: list[dict]) -> tuple[set[Grant], list[str]]:
    """What the operator's ServiceAccount may do, and what is wrong with the RBAC objects beside it (a role
    no binding gives the operator, a binding to a role that is not there, rules RBAC would read otherwise
    than this test)."""
    deploy = operator_deployment(docs)
    account = {"kind": "ServiceAccount", "name": deploy["spec"]["template"]["spec"]["serviceAccountName"],
               "namespace": deploy["metadata"]["namespace"]}
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    grants: set[Grant] = set()
    problems: list[str] = []
    used = set()
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if account not in binding["subjects"]:
            continue
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        key = (ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])
        if key not in roles:
            problems.append(f"{binding['kind']} {binding['metadata']['name']} refers to {key}, which is not shipped")
            continue
        used.add(key)
        for rule in roles[key]["rules"]:
            if set(rule) - {"apiGroups", "resources", "verbs"}:
                problems.append(f"{key}: a rule with {sorted(set(rule) - {'apiGroups', 'resources', 'verbs'})}")
            grants |= {Grant(scope, group, resource, verb) for group in rule["apiGroups"]
                       for resource in rule["resources"] for verb in rule["verbs"]}
    problems += [f"{kind} {ns or ''}/{name}: no binding gives it to the operator"
                 for kind, ns, name in set(roles) - used]
    return grants, problems


# --- the operator's calls ------------------------------------------------------------------------


def client_api_methods() -> set[str]:
    """Every public method of the kubernetes client's API classes (CoreV1Api, CustomObjectsApi, ...)."""
    import kubernetes.client.api as apis

    return {name for _, cls in inspect.getmembers(apis, inspect.isclass)
            for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def _argument(call: ast.Call, method: str, name: str, module: Any) -> Any:
    """The value of a client call's argument, resolved against the module's globals."""
    params = list(inspect.signature(getattr(kubernetes.client.CustomObjectsApi, method)).parameters)[1:]
    node = next((k.value for k in call.keywords if k.arg == name), None)
    if node is None:
        node = call.args[params.index(name)]
    try:
        return eval(compile(ast.Expression(node), "<argument>", "eval"), vars(module))  # names and constants
    except NameError as exc:
        raise AssertionError(f"{module.__name__}: {method}'s {name} is not a module-level name or constant "
                             f"({ast.unparse(node)}): the test cannot tell which resource it calls") from exc


def client_calls(sources: Iterable[tuple[Any, str]]) -> dict[tuple[str, str, str, bool], list[str]]:
    """(group, resource, verb, all namespaces) -> where in the source, for every kubernetes client call."""
    methods = client_api_methods()
    found: dict[tuple[str, str, str, bool], list[str]] = {}
    for module, text in sources:
        tree = ast.parse(text)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            method = node.attr.removesuffix("_with_http_info")
            if method not in methods:
                continue
            where = f"{module.__name__}:{node.lineno} {method}"
            assert method in CLIENT_METHODS, (
                f"{where}: a kubernetes client call the RBAC test does not know: add it to CLIENT_METHODS in "
                "tests/operator/test_rbac.py with the grant it needs, then the grant to the manifests")
            parent = parents.get(node)
            verbs = [CLIENT_METHODS[method].verb]
            if isinstance(parent, ast.Call) and parent.func is node:
                call = parent
            elif (isinstance(parent, ast.Call) and parent.args and parent.args[0] is node
                  and isinstance(parent.func, ast.Attribute) and parent.func.attr == "stream"):
                # kubernetes.watch.Watch().stream(api.list_..., *args): a list, then a watch
                call = ast.Call(func=node, args=parent.args[1:], keywords=parent.keywords)
                verbs.append("watch")
            else:
                raise AssertionError(f"{where}: used but not called, the test cannot see its arguments")
            entry = CLIENT_METHODS[method]
            names = {}
            if "{" in entry.group + entry.resource:
                names = {n: _argument(call, method, n, module) for n in ("group", "plural")}
            for verb in verbs:
                key = (entry.group.format(**names), entry.resource.format(**names), verb, entry.all_namespaces)
                found.setdefault(key, []).append(where)
    return found


def operator_sources() -> list[tuple[Any, str]]:
    return [(importlib.import_module(f"kvpool_operator.{path.stem}"), path.read_text())
            for path in sorted(PACKAGE.glob("*.py")) if path.stem != "__init__"]


def crd_resource() -> references.Resource:
    """The KVCachePolicy resource as kopf's discovery sees it (kopf/_cogs/clients/scanning.py)."""
    crd = yaml.safe_load((ROOT / "crds" / "kvcachepolicy.yaml").read_text())["spec"]
    [version] = [v for v in crd["versions"] if v["storage"]]
    return references.Resource(
        group=crd["group"], version=version["name"], plural=crd["names"]["plural"], kind=crd["names"]["kind"],
        singular=crd["names"]["singular"], shortcuts=frozenset(crd["names"].get("shortNames", [])),
        namespaced=crd["scope"] == "Namespaced", subresources=frozenset(version.get("subresources", {})),
        preferred=True, verbs=frozenset({"list", "watch", "patch"}),
    )


class KopfRun(NamedTuple):
    clusterwide: bool
    namespaces: list[str]
    settings: kopf.OperatorSettings
    registry: kopf.OperatorRegistry


def start_kopf(args: list[str], monkeypatch: pytest.MonkeyPatch) -> KopfRun:
    """`kvpool-operator ARGS` as the Deployment runs it, up to kopf.run (caught): the mode and the
    settings kopf would run with, its startup handlers applied, and the handlers it registered."""
    import prometheus_client
    from kvpool_operator import cli

    registry = kopf.OperatorRegistry()
    previous = kopf.get_default_registry()
    kopf.set_default_registry(registry)
    try:
        monkeypatch.delitem(sys.modules, "kvpool_operator.handlers", raising=False)  # registers afresh
        caught: dict[str, Any] = {}
        monkeypatch.setattr(kopf, "run", lambda **kwargs: caught.update(kwargs))

        class Server:
            def shutdown(self) -> None:
                pass

        monkeypatch.setattr(prometheus_client, "start_http_server", lambda *a, **k: (Server(), None))
        assert cli.main(args) == 0
    finally:
        kopf.set_default_registry(previous)
    settings = kopf.OperatorSettings()
    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda *a, **k: None)
    monkeypatch.setattr(kubernetes.config, "load_kube_config", lambda *a, **k: None)
    for handler in registry._activities.get_handlers(activity=causes.Activity.STARTUP):
        result = handler.fn(settings=settings, logger=logging.getLogger(__name__), memo=kopf.Memo())
        if inspect.isawaitable(result):
            asyncio.run(result)
    # What kopf.run does with its arguments (kopf/_core/reactor/running.py, spawn_tasks).
    settings.peering.clusterwide = caught["clusterwide"]
    if caught.get("standalone") is not None:
        settings.peering.standalone = caught["standalone"]
    return KopfRun(caught["clusterwide"], list(caught.get("namespaces") or []), settings, registry)


def kopf_needs(run: KopfRun, resources: list[references.Resource]) -> dict[Grant, str]:
    """kopf's own calls (kopf 1.45), each with the place in kopf that makes it."""
    scopes: list[str | None] = [None] if run.clusterwide else list(run.namespaces)
    needs: dict[Grant, str] = {}

    def need(scope: str | None, group: str, resource: str, verbs: Iterable[str], why: str) -> None:
        needs.update({Grant(scope, group, resource, verb): why for verb in verbs})

    registry = run.registry
    changing = registry._changing.get_all_handlers() + registry._spawning.get_all_handlers()
    watched = (registry._watching.get_all_handlers() + registry._indexing.get_all_handlers()) + changing
    assert not registry._webhooks.get_all_handlers(), "admission webhooks: add kopf's grants for them here"
    for resource in resources:
        handlers = [h for h in watched if h.selector is not None and h.selector.check(resource)]
        if not handlers:
            continue
        for scope in scopes:
            # _core/reactor/queueing.py watcher -> _cogs/clients/watching.py: a list
            # (_cogs/clients/fetching.py fetch_objs), then ?watch=true from its resourceVersion.
            need(scope, resource.group, resource.plural, ["list", "watch"], "kopf's watch of its resources")
            if any(h in changing for h in handlers):
                # _cogs/clients/patching.py patch_obj: its finalizer (delete handlers, timers), the
                # last-handled-configuration and progress annotations; a status, handlers' patch.status
                # and its progress under status.kopf, through /status when the CRD has that subresource.
                need(scope, resource.group, resource.plural, ["patch"], "kopf's finalizer and annotations")
                if "status" in resource.subresources:
                    need(scope, resource.group, f"{resource.plural}/status", ["patch"], "kopf's status patches")
    if run.settings.posting.enabled:
        # _core/engines/posting.py poster -> _cogs/clients/events.py post_event: a core v1 Event
        # (references.EVENTS) created in the namespace of the object it is about.
        for scope in scopes:
            need(scope, "", "events", ["create"], "kopf's Events (kopf.warn, handler progress)")
    if not run.settings.scanning.disabled:
        # _core/reactor/observation.py resource_observer: CRDs watched (references.CRDS) cluster-wide.
        need(None, "apiextensions.k8s.io", "customresourcedefinitions", ["list", "watch"], "kopf's CRD scan")
        if not run.clusterwide:
            # observation.py namespace_observer: namespaces listed and watched to match the patterns.
            need(None, "", "namespaces", ["list", "watch"], "kopf's namespace scan")
    if not run.settings.peering.standalone:
        # _core/engines/peering.py: the peering objects watched (orchestration.py) and patched (touch, clean).
        plural = "clusterkopfpeerings" if run.clusterwide else "kopfpeerings"
        for scope in scopes:
            need(scope, "kopf.dev", plural, ["list", "watch", "patch"], "kopf's peering")
    # Discovery (_cogs/clients/scanning.py: /version, /api, /apis/GROUP/VERSION) is non-resource URLs,
    # which the cluster's system:discovery role gives every authenticated user: nothing to grant here.
    return needs


def owner_reference_needs(sources: Iterable[tuple[Any, str]], scopes: list[str | None]) -> dict[Grant, str]:
    """The OwnerReferencesPermissionEnforcement admission plugin (plugin/pkg/admission/gc in Kubernetes):
    setting an object's ownerReferences needs `delete` on the object, and blockOwnerDeletion `update` on the
    owner's finalizers subresource. The operator's writes: render_configmap with an owner uid."""
    from kvpool_operator.render import render_configmap
    from kvpool_sidecar.config import load_policy

    owned = any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) ==
                "render_configmap" and any(k.arg == "owner_uid" for k in node.keywords)
                for _, text in sources for node in ast.walk(ast.parse(text)))
    if not owned:
        return {}
    meta, spec = load_policy((ROOT / "crds" / "examples" / "chat.yaml").read_text())
    written = render_configmap(meta["name"], meta["namespace"], 1, spec, owner_uid="uid")
    resource = crd_resource()
    needs: dict[Grant, str] = {}
    for ref in written["metadata"].get("ownerReferences", []):
        group, resource_name = WRITTEN_KINDS[written["kind"]]
        assert (ref["apiVersion"], ref["kind"]) == (f"{resource.group}/{resource.version}", resource.kind), ref
        for scope in scopes:
            needs[Grant(scope, group, resource_name, "delete")] = "ownerReferences on what it writes"
            if ref.get("blockOwnerDeletion"):
                needs[Grant(scope, resource.group, f"{resource.plural}/finalizers", "update")] = "blockOwnerDeletion"
    return needs


def operator_needs(docs: list[dict], monkeypatch: pytest.MonkeyPatch) -> tuple[KopfRun, dict[Grant, str]]:
    args = operator_deployment(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    run = start_kopf(args, monkeypatch)
    scopes: list[str | None] = [None] if run.clusterwide else list(run.namespaces)
    sources = operator_sources()
    needs = kopf_needs(run, [crd_resource()])
    for (group, resource, verb, all_namespaces), where in client_calls(sources).items():
        for scope in [None] if all_namespaces else scopes:
            needs.setdefault(Grant(scope, group, resource, verb), ", ".join(where))
    for grant, why in owner_reference_needs(sources, scopes).items():
        needs.setdefault(grant, why)
    return run, needs


def compare(needs: dict[Grant, str], grants: set[Grant]) -> list[str]:
    missing = [f"missing: {g} ({needs[g]})" for g in sorted(set(needs) - grants, key=str)]
    unused = [f"granted, never used: {g}" for g in sorted(grants - set(needs), key=str)]
    return missing + unused


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_the_rbac_grants_exactly_what_the_operator_calls(mode: str, monkeypatch: pytest.MonkeyPatch):
    """Each mode's RBAC, as kustomize builds it, gives the operator's ServiceAccount every grant its calls
    need, where they need it (every namespace, or each watched one), and nothing else."""
    docs = render(MODES[mode])
    run, needs = operator_needs(docs, monkeypatch)
    assert run.clusterwide == (mode == "clusterwide") and (run.clusterwide or run.namespaces)
    grants, problems = granted(docs)
    assert not problems, problems
    assert not compare(needs, grants), "\n".join(compare(needs, grants))
    if mode == "namespaced":  # namespaced grants only, but for the two reads kopf makes across the cluster
        cluster = {g for g in grants if g.namespace is None}
        assert {(g.resource, g.verb) for g in cluster} <= {
            ("customresourcedefinitions", "list"), ("customresourcedefinitions", "watch"),
            ("namespaces", "list"), ("namespaces", "watch")}


def test_a_grant_removed_or_added_is_reported(monkeypatch: pytest.MonkeyPatch):
    docs = render(MODES["namespaced"])
    _, needs = operator_needs(docs, monkeypatch)
    [role] = [d for d in docs if d["kind"] == "Role"]
    configmaps = next(r for r in role["rules"] if r["resources"] == ["configmaps"])
    configmaps["verbs"] = [v for v in configmaps["verbs"] if v != "create"] + ["list"]
    grants, _ = granted(docs)
    create = Grant("llm", "", "configmaps", "create")
    assert needs[create].startswith("kvpool_operator.handlers:") and "create_namespaced_config_map" in needs[create]
    assert compare(needs, grants) == [f"missing: create configmaps (core) in namespace llm ({needs[create]})",
                                      "granted, never used: list configmaps (core) in namespace llm"]
    role["metadata"]["namespace"] = "other"  # a Role in a namespace the operator does not watch
    _, problems = granted(docs)
    assert sorted(problems) == ["Role other/kvpool-operator: no binding gives it to the operator",
                                "RoleBinding kvpool-operator refers to ('Role', 'llm', 'kvpool-operator'), which is "
                                "not shipped"]


def test_every_client_call_the_operator_makes_has_its_grant_in_the_table():
    from kvpool_operator import handlers

    calls = client_calls(operator_sources())
    assert ("", "pods", "list", False) in calls and ("kvpool.dev", "kvcachepolicies/status", "patch", False) in calls
    with pytest.raises(AssertionError, match="list_namespaced_secret.*add it to CLIENT_METHODS"):
        client_calls([(handlers, "def f(api):\n    return api.list_namespaced_secret('llm')\n")])
    watched = client_calls([(handlers, "def f(w, api):\n    w.stream(api.list_namespaced_pod, 'llm')\n")])
    assert set(watched) == {("", "pods", "list", False), ("", "pods", "watch", False)}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("mode", MODES)
def test_render_matches_kustomize(mode: str):
    out = subprocess.run(["kubectl", "kustomize", str(MODES[mode])], capture_output=True, text=True, check=True,
                         timeout=60).stdout

    def key(doc: dict) -> tuple[str, str, str]:
        return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]

    built = sorted((d for d in yaml.safe_load_all(out) if d), key=key)
    assert built == sorted(render(MODES[mode]), key=key)
