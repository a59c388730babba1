"""To-C conversations beside to-B bursts through vLLM's OpenAI server, a tier smaller than the working
set, side by side in one run per seed: kvpool as shipped (the admin's mapping puts the to-B adapter's
requests in the to-B class; the shared document named in ``pinning.prompts``), kvpool with
isolation 0 and LRU (no mapping, no named prompt), LMCache LRU on the same bytes, and vLLM alone.

    .venv/bin/python bench/classes.py                          # tiny model, seeds 1-3, bursts of both kinds
    .venv/bin/python bench/classes.py --model mid --seeds 1
    .venv/bin/python bench/classes.py --tob flood,return --systems vllm,kvpool

Traffic (``--seed`` fixes every prompt and every think time; identical for every system):
* to-C: ``--conversations`` chats, each ``--turns`` turns, every prompt opening with one shared system
  prompt (``--system-len`` tokens); a turn's prompt is the previous one plus a reply and a user
  message, sent ``--think`` seconds (uniform) after the previous answer: reuse within seconds to a
  minute, of the previous turn's whole prompt.
* a shared document (``--doc-len`` tokens, a manual, a contract) asked about every ``--doc-every``
  seconds with a fresh question: to-C traffic that comes back less often than the to-B flood turns the
  tier over, the case a pinned prompt is for (kvpool as shipped names it in ``pinning.prompts``).
* to-B: a burst of ``--burst`` prompts of ``--tob-len`` tokens every ``--burst-every`` seconds, served
  with the LoRA adapter ``tob`` (a random rank-8 adapter built here: the engine hands the connector
  its name, which the admin's mapping ``workloads.adapters`` reads; no client can claim it). ``--tob``
  names the kinds to run, comma-separated: ``unique``: never sent again; ``return``: each sent again
  1-3 s later; ``flood``: no bursts, but ``--flood-clients`` clients sending fresh prompts back to back
  for ``--duration`` seconds (never sent again: the flood of issue 67; closed-loop, so a system that
  serves slower receives fewer to-B prompts in the same time); ``both``: unique and return.
Each request streams (TTFT is its first token's arrival) and returns vLLM's per-request cached prompt
tokens (``--enable-prompt-tokens-details``: vLLM's own cache and the tier together).

Figures per system: to-C prompt tokens cached and, beside it, that minus vLLM alone's in the same round
(what the tier added: an estimate, since vLLM's own cache does not evict identically in every run), the
share of to-C's reusable tokens that were cached (vLLM's own cache and the tier; reusable: each prompt's
whole blocks shared with the prompt before it in its chat, the system prompt for every chat's first turn
but the first chat's, the document for every question but the first, at most the prompt's length less
one token, which the engine always computes),
second-tier tokens in all (vLLM's ``external_prefix_cache_hits``), to-C TTFT p50/p99, requests/s over
the run, and the share of document questions that found the whole document cached (vLLM's cache or the
tier; its first, which computes it, counted too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "dev"))
from serve import BLOCK, Stack, build_mid_model, metric  # noqa: E402
from tiny_model import KV_SHAPE as TINY_KV_SHAPE  # noqa: E402
from tiny_model import VOCAB, build_tiny_model  # noqa: E402

SYSTEMS = ("vllm", "lmcache", "kvpool-lru", "kvpool-iso0", "kvpool")


def build_adapter(model: Path, folder: Path) -> Path:
    """A random rank-8 LoRA adapter on q_proj and v_proj of ``model`` (PEFT's file layout)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, head_dim = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out in outs.items():
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(8, hidden, generator=gen) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, 8, generator=gen) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": list(outs), "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model)}))
    return folder


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


Turns = list[tuple[float, list[int]]]


def reusable_tokens(args: argparse.Namespace, doc: list[int], chats: list[Turns], questions: Turns) -> int:
    """to-C's prompt tokens an engine with an unbounded cache could find cached (the module doc's rule)."""

    def shared(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return min(n, len(b) - 1) // BLOCK * BLOCK

    total = 0
    for c, turns in enumerate(chats):
        previous: list[int] = []
        for t, (_, prompt) in enumerate(turns):
            if t:
                total += shared(previous, prompt)
            elif c:
                total += shared(chats[0][0][1], prompt)  # the system prompt
            previous = prompt
    total += sum(shared(doc, prompt) for _, prompt in questions[1:])
    return total


def plan(args: argparse.Namespace, seed: int) -> tuple[list[int], list[Turns], Turns, list]:
    """The document, each conversation's turns (think time before it, prompt), the document's questions
    (wait before each, prompt) and the to-B sends (time, prompt): the same for every system."""
    rng = random.Random(seed)
    system, doc = tokens(rng, args.system_len), tokens(rng, args.doc_len)
    chats = []
    for _ in range(args.conversations):
        prompt, turns = list(system), []
        for turn in range(args.turns):
            prompt = prompt + (tokens(rng, args.reply_len) if turn else []) + tokens(rng, args.user_len)
            turns.append((rng.uniform(*args.think) if turn else rng.uniform(0, args.burst_every * 4), list(prompt)))
        chats.append(turns)
    asks = int(args.duration // args.doc_every)
    questions = [(args.doc_every, doc + tokens(rng, args.user_len)) for _ in range(asks)]
    sends = []
    t = 0.0
    if args.tob == "flood":  # prompts for the flood's clients, sent back to back (more than they can send)
        return doc, chats, questions, [(0.0, tokens(rng, args.tob_len)) for _ in range(args.flood_prompts)]
    while t < args.duration:
        for _ in range(args.burst):
            p = tokens(rng, args.tob_len)
            sends.append((t + rng.uniform(0, 0.2), p))
            if args.tob == "return":
                sends.append((t + rng.uniform(1, 3), p))
        t += args.burst_every
    return doc, chats, questions, sorted(sends, key=lambda s: s[0])


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int, *,
              extra: dict | None = None, token_ids: list[int] | None = None) -> tuple[float, int]:
    """Stream one completion: (TTFT in ms, cached prompt tokens). ``extra``: more keys of the request's body
    (``kv_transfer_params``: bench/replicas.py); ``token_ids``: a list the generated token ids are appended to."""
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    if token_ids is not None:
        body["return_token_ids"] = True  # vLLM's: each chunk's choice carries its new tokens' ids
    start = time.perf_counter()
    ttft, cached = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        buffer = ""
        # Split on "\n" only: a random model's text may hold U+2028 or U+0085, which aiter_lines splits at.
        async for chunk in r.aiter_text():
            buffer += chunk
            *lines, buffer = buffer.split("\n")
            for line in lines:
                line = line.rstrip("\r")
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if ttft is None and data.get("choices"):
                    ttft = 1000 * (time.perf_counter() - start)
                if token_ids is not None:
                    for choice in data.get("choices") or ():
                        token_ids.extend(choice.get("token_ids") or ())
                usage = data.get("usage")
                if usage:
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return ttft or 0.0, cached


async def drive(url: str, args: argparse.Namespace, doc: list[int], chats: list[Turns], questions: Turns,
                sends: list) -> dict:
    limit = asyncio.Semaphore(args.concurrency)
    toc: list[tuple[float, int, int]] = []  # (ttft, cached, prompt length)
    doc_cached: list[int] = []
    returns: list[tuple[int, int]] = []  # to-B's returns: (cached tokens, whole blocks of the prompt)
    done = {"n": 0}
    async with httpx.AsyncClient(timeout=600) as client:
        async def chat(turns: Turns, seen: list[int] | None = None) -> None:
            for think, prompt in turns:
                await asyncio.sleep(think)
                async with limit:
                    ttft, cached = await one(client, url, "base", prompt, args.output_len)
                toc.append((ttft, cached, len(prompt)))
                if seen is not None:
                    seen.append(cached)
                done["n"] += 1

        async def flood() -> None:
            start = time.monotonic()
            queue = [prompt for _, prompt in sends]

            async def client_loop() -> None:
                while queue and time.monotonic() - start < args.duration:
                    prompt = queue.pop()
                    async with limit:
                        await one(client, url, "tob", prompt, args.output_len)
                    done["n"] += 1

            await asyncio.gather(*(client_loop() for _ in range(args.flood_clients)))

        async def tob() -> None:
            if args.tob == "flood":
                await flood()
                return
            start = time.monotonic()

            async def send(prompt: list[int]) -> None:
                async with limit:
                    await one(client, url, "tob", prompt, args.output_len)
                done["n"] += 1

            async def send_again(prompt: list[int]) -> None:  # a return: what it found cached
                async with limit:
                    _, cached = await one(client, url, "tob", prompt, args.output_len)
                returns.append((cached, (len(prompt) - 1) // BLOCK * BLOCK))
                done["n"] += 1

            tasks = []
            sent: set[tuple[int, ...]] = set()
            for at, prompt in sends:
                if tuple(prompt) in sent:
                    await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
                    tasks.append(asyncio.create_task(send_again(prompt)))
                    continue
                sent.add(tuple(prompt))
                await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
                tasks.append(asyncio.create_task(send(prompt)))
            await asyncio.gather(*tasks)

        start = time.monotonic()
        await asyncio.gather(tob(), chat(questions, doc_cached), *(chat(turns) for turns in chats))
        wall = time.monotonic() - start
    ttfts = sorted(t for t, _, _ in toc)
    whole_doc = (len(doc) // BLOCK) * BLOCK
    return {
        "toc_cached": sum(c for _, c, _ in toc), "toc_prompt": sum(n for _, _, n in toc),
        "ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "rps": done["n"] / wall, "doc_hits": sum(c >= whole_doc for c in doc_cached) / max(1, len(doc_cached)),
        "returns": (sum(c for c, _ in returns) / sum(n for _, n in returns)) if returns else None,
    }


def kvpool_config(system: str, model: Path, doc: list[int]) -> str:
    if system == "kvpool-lru":
        return f"pageSize: {BLOCK}\neviction: {{policy: lru}}\nworkloads: {{toB: {{isolationPercent: 0}}}}\n"
    config: dict = {"pageSize": BLOCK, "workloads": {"adapters": [{"adapter": "tob", "workloadClass": "toB"}]},
                    "pinning": {"prompts": [{"name": "document", "model": str(model), "tokens": doc}]}}
    if system == "kvpool-iso0":  # as shipped, but one shared partition
        config["workloads"]["toB"] = {"isolationPercent": 0}
    return json.dumps(config)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "mid"), default="tiny")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--tob", default="both", help="to-B kinds, comma-separated: unique, return, flood, both")
    ap.add_argument("--flood-clients", type=int, default=4, help="--tob flood: to-B clients sending back to back")
    ap.add_argument("--flood-prompts", type=int, default=2000, help="--tob flood: prompts prepared (at most)")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=96)
    ap.add_argument("--doc-len", type=int, default=512)
    ap.add_argument("--doc-every", type=float, default=8.0, help="seconds between the document's questions")
    ap.add_argument("--reply-len", type=int, default=16)
    ap.add_argument("--think", type=float, nargs=2, default=(2.0, 8.0), help="seconds between a chat's turns")
    ap.add_argument("--burst", type=int, default=6)
    ap.add_argument("--burst-every", type=float, default=2.0)
    ap.add_argument("--tob-len", type=int, default=512)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of to-B bursts")
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=120, help="vLLM's own cache (blocks of 32 tokens)")
    ap.add_argument("--pool-pages", type=int, default=300, help="the second tier (pages of 32 tokens)")
    args = ap.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {', '.join(sorted(set(systems) - set(SYSTEMS)))} (known: {', '.join(SYSTEMS)})")
    work = Path(tempfile.mkdtemp(prefix="kvpool-classes-"))
    if args.model == "tiny":
        model, kv_shape = build_tiny_model(work / "tiny"), TINY_KV_SHAPE
    else:
        model, kv_shape = build_mid_model(Path(tempfile.gettempdir()) / "kvpool-mid-model")
    adapter = build_adapter(model, work / "adapter")
    args.vllm_extra = ["--enable-lora", "--lora-modules", f"tob={adapter}", "--max-lora-rank", "8",
                       "--served-model-name", "base", "--enable-prompt-tokens-details"]
    args.tensor_parallel_size = 1
    kinds = [k for kind in args.tob.split(",") for k in (("unique", "return") if kind == "both" else (kind,))]
    if set(kinds) - {"unique", "return", "flood"}:
        ap.error(f"--tob: unknown {', '.join(sorted(set(kinds) - {'unique', 'return', 'flood'}))} (known: unique, "
                 "return, flood, both)")
    print(f"model {args.model}; vLLM's cache {args.gpu_blocks} blocks, second tier {args.pool_pages} pages of {BLOCK}; "
          f"{args.conversations} chats x {args.turns} turns (system prompt {args.system_len}), to-B {args.burst} x "
          f"{args.tob_len} tokens every {args.burst_every:g} s for {args.duration:g} s (a flood: {args.flood_clients} "
          "clients back to back)")
    print("| to-B | seed | system | to-C tokens cached | minus vLLM alone's | share of to-C's reusable "
          "| 2nd-tier tokens | to-C TTFT p50 ms | p99 ms | req/s | document hits | to-B returns cached |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        args.tob = kind
        for rnd, seed in enumerate(int(s) for s in args.seeds.split(",")):
            doc, chats, questions, sends = plan(args, seed)
            reusable = reusable_tokens(args, doc, chats, questions)
            rows = {}
            for system in (systems if rnd % 2 == 0 else systems[::-1]):
                args.kvpool_config = kvpool_config(system, model, doc)
                sys_work = work / f"{kind}-{seed}-{system}"
                sys_work.mkdir()
                stack = Stack("kvpool" if system.startswith("kvpool") else system, args, model, kv_shape, sys_work)
                try:
                    before = httpx.get(stack.url + "/metrics", timeout=10).text
                    row = asyncio.run(drive(stack.url, args, doc, chats, questions, sends))
                    after = httpx.get(stack.url + "/metrics", timeout=10).text
                    name = "vllm:external_prefix_cache_hits_total"
                    row["external"] = metric(after, name) - metric(before, name)
                    rows[system] = row
                finally:
                    stack.close()
            base = rows.get("vllm")
            for system in systems:
                r = rows[system]
                extra = f"{r['toc_cached'] - base['toc_cached']:,}" if base else "-"
                print(f"| {kind} | {seed} | {system} | {r['toc_cached']:,} / {r['toc_prompt']:,} | {extra} | "
                      f"{r['toc_cached'] / reusable:.2f} of {reusable:,} | {int(r['external']):,} | "
                      f"{r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['rps']:.2f} | {100 * r['doc_hits']:.0f} % | "
                      f"{'-' if r['returns'] is None else format(r['returns'], '.2f')} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
