"""A starting sidecar fetches the policy's named prompts (``pinning.prompts``) from a peer that holds them,
before its engine's first request, instead of waiting for that engine to compute them.

Its engine has not connected yet, so this sidecar does not know how the engine names the prompt's pages: it
asks each member how its own engines of the prompt's model hash their blocks (:class:`~kvpool_sidecar.peers.
protocol.Schemes`; that peer checked its engine's hashing against a probe vLLM computed), names the prompt's
pages with it, and fetches them as any fetch (published only once read whole, in the default tenant and class,
as the named prompts' pins hold them). A prompt fetched whole or in part takes that hashing here until an
engine of its own says otherwise, so the named prompt's pin holds its pages from then on. One pass over the
members known at start, bounded by ``budget`` seconds: a prompt no member holds is left to the engine to
compute, as without peers. ``/readyz`` answers 503 ``warming_up`` until the pass is over.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvpool_sidecar.config import PinnedPrompt
from kvpool_sidecar.errors import InvalidRequest
from kvpool_sidecar.keys import WorkloadMeta, engine_block_hashes
from kvpool_sidecar.peers.client import PeerClient
from kvpool_sidecar.service.state import Sidecar

log = logging.getLogger("kvpool.peers")
WARMUP_SECONDS = 30.0
RESULTS = ("fetched", "partial", "none")


class WarmUp:
    """The start-up pass; ``done`` once it is over (or there is nothing to do)."""

    def __init__(self, sidecar: Sidecar, client: PeerClient, budget: float = WARMUP_SECONDS) -> None:
        self.sidecar = sidecar
        self.client = client
        self.budget = budget
        self.done = budget <= 0 or not sidecar.state.config.spec().pinning.prompts
        self.results: dict[str, str] = {}

    async def run(self) -> None:
        if self.done:
            return
        start = time.monotonic()
        try:
            await asyncio.wait_for(self._prompts(start + self.budget), self.budget)
        except TimeoutError:
            log.warning("warm-up: not over after %g s: the rest of the named prompts is left to the engine",
                        self.budget)
        finally:
            self.done = True
        log.info("warm-up from peers in %.2f s: %s", time.monotonic() - start,
                 ", ".join(f"{name} {result}" for name, result in self.results.items()) or "no prompt")

    async def _prompts(self, deadline: float) -> None:
        for prompt in self.sidecar.state.config.spec().pinning.prompts:
            result = await self._prompt(prompt, deadline)
            self.results[prompt.name] = result
            self.sidecar.metrics.peer_warmups.labels(result).inc()
        await self.sidecar.run_background(self.sidecar.keep_prompts_pinned)

    async def _prompt(self, prompt: PinnedPrompt, deadline: float) -> str:
        """``fetched`` (every full page cached here now), ``partial`` or ``none``."""
        ps = self.sidecar.pool.page_size
        best = "none"
        for peer in sorted(self.client.members):
            for scheme in await self.client.schemes(peer, prompt.model, deadline - time.monotonic()):
                try:
                    hashes = await asyncio.to_thread(engine_block_hashes, prompt.tokens, ps, scheme.algo, scheme.seed)
                except InvalidRequest as exc:  # a hashing this sidecar cannot compute
                    log.info("warm-up of %s: %s", prompt.name, exc)
                    continue
                if not hashes:
                    return "none"  # shorter than a page: nothing to hold
                got = await self.client.fetch(peer, scheme.identity, hashes, WorkloadMeta(),
                                              max(0.0, deadline - time.monotonic()))
                if got.cached_pages:
                    self.sidecar.adopt_engine_hashing(scheme.identity, scheme.algo, scheme.seed)
                if got.cached_pages == len(hashes):
                    return "fetched"
                if got.cached_pages:
                    best = "partial"
        return best
