"""``kvpool-operator``: run the operator, print the CRD, render a policy offline."""

from __future__ import annotations

import argparse
import sys

import yaml
from kvpool_sidecar.config import ConfigError, load_policy

from kvpool_operator.crd import crd
from kvpool_operator.render import render_configmap


def cmd_render(args: argparse.Namespace) -> int:
    try:
        with open(args.file) as fh:
            meta, spec = load_policy(fh.read())
    except (OSError, ConfigError) as exc:
        print(f"kvpool-operator render: error: {exc}", file=sys.stderr)
        return 2
    cm = render_configmap(meta["name"], meta.get("namespace") or "default", int(meta.get("generation") or 1), spec)
    sys.stdout.write(yaml.safe_dump(cm, sort_keys=False))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    sys.stdout.write(yaml.safe_dump(crd(), sort_keys=False))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import kopf

    import kvpool_operator.handlers  # noqa: F401  (registers the handlers)

    server = None
    if args.metrics_port:
        from prometheus_client import start_http_server

        from kvpool_operator.metrics import REGISTRY

        # Read-only and open, but only where asked: loopback unless --metrics-host.
        server, _ = start_http_server(args.metrics_port, args.metrics_host or "127.0.0.1", registry=REGISTRY)
    namespaces = args.namespace or []
    try:
        kopf.run(
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz",
            standalone=args.standalone,
        )
    finally:
        if server is not None:
            server.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool-operator", description="kvpool's Kubernetes operator")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="reconcile KVCachePolicy resources (all namespaces unless --namespace)")
    run.add_argument("--namespace", action="append", help="watch only this namespace (repeatable)")
    run.add_argument("--liveness-port", type=int, default=8080)
    run.add_argument("--metrics-port", type=int, help="serve the operator's /metrics on this port (off without it)")
    run.add_argument("--metrics-host", help="the address /metrics listens on (default 127.0.0.1)")
    run.add_argument("--standalone", action="store_true", help="no peering with other operator replicas")
    run.set_defaults(func=cmd_run)
    render = sub.add_parser("render", help="validate a KVCachePolicy and print the ConfigMap it renders")
    render.add_argument("-f", "--file", required=True)
    render.set_defaults(func=cmd_render)
    crd_cmd = sub.add_parser("crd", help="print the CustomResourceDefinition (generated from the spec model)")
    crd_cmd.set_defaults(func=cmd_crd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
