"""Auto-pin against none: the shipped policy with each auto-pin rule on and off, same pool, same traces.

    .venv/bin/python bench/measurements/autopin.py [--capacity 0.02 0.05 0.1] [--seeds 11 12 13] [--profiles to-b ...]

Token hit ratio of the shipped defaults with: both auto-pin rules (long prompts of at least
``minPromptTokens``, prefixes hotter than ``minPrefixQPS``), each rule alone, and none; on the shipped
traces and on synth traces of every profile at seeds no other measurement used.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.replay import parse_lines, read_trace, replay_pool
from kvpool_sidecar.replay.synth import PROFILES, generate

TRACES = Path(__file__).resolve().parents[2] / "traces"
NEVER = 1 << 30  # a threshold no prompt or prefix reaches


def variants() -> dict[str, KVCachePolicySpec]:
    def spec(enabled: bool, min_tokens: int | None = None, min_qps: float | None = None) -> KVCachePolicySpec:
        data = KVCachePolicySpec().model_dump()
        auto = data["pinning"]["autoPin"]
        auto["enabled"] = enabled
        if min_tokens is not None:
            auto["minPromptTokens"] = min_tokens
        if min_qps is not None:
            auto["minPrefixQPS"] = min_qps
        return KVCachePolicySpec.model_validate(data)

    return {"both": spec(True, 1024, 100), "long-prompt": spec(True, 1024, NEVER),
            "hot-prefix": spec(True, NEVER, 100), "none": spec(False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[11, 12, 13])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    parser.add_argument("--no-shipped", action="store_true", help="synth traces only")
    args = parser.parse_args()
    shipped = [] if args.no_shipped else ["mooncake_conversation.jsonl.gz", "mooncake_synthetic.jsonl.gz"]
    traces = [read_trace(TRACES / n) for n in shipped]
    traces += [parse_lines(generate(p, args.requests, seed), f"{p}:{seed}") for p in args.profiles
               for seed in args.seeds]
    specs = variants()
    # "hot-prefix" is what KVCachePolicySpec() ships; "both" what it shipped before (minPromptTokens 1024).
    print("trace capacity " + " ".join(f"{name:>11}" for name in specs) + "  shipped-none")
    for trace in traces:
        for capacity in args.capacity:
            ratios = {name: replay_pool(trace, KVCachePolicySpec().eviction.policy, capacity, spec).token_hit_ratio
                      for name, spec in specs.items()}
            print(f"{trace.name} {capacity:g} " + " ".join(f"{r:11.4f}" for r in ratios.values())
                  + f"  {ratios['hot-prefix'] - ratios['none']:+.4f}", flush=True)


if __name__ == "__main__":
    main()
