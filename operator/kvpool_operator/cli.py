"""``kvpool-operator``: offline rendering today; the kopf runner lands with the operator issue."""

from __future__ import annotations

import argparse
import sys

import yaml
from kvpool_sidecar.config import ConfigError, load_policy, spec_hash


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvpool-operator")
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="validate a KVCachePolicy and print the sidecar config it gives")
    render.add_argument("-f", "--file", required=True, help="KVCachePolicy manifest (YAML)")
    args = parser.parse_args(argv)
    if args.command == "render":
        try:
            with open(args.file) as fh:
                meta, spec = load_policy(fh.read())
        except (OSError, ConfigError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        data = spec.model_dump(mode="json")
        data["source"] = {
            "name": meta["name"],
            "namespace": meta.get("namespace", "default"),
            "generation": int(meta.get("generation", 0) or 0),
            "hash": spec_hash(spec),
        }
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
