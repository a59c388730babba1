"""Pins in the engine's key space: by token ids through the API, and the policy's named prompts
(``pinning.prompts``), kept pinned.

A named prompt has no pages until an engine serving its model computes it once and saves it, or a
starting sidecar fetches it from a peer that holds it (:mod:`.warmup`); from then on the sidecar holds its
pages pinned (re-pinned as more of it is saved, or after someone
removed the pin). Its pages count against the pin quota like any pin; a config whose prompts cannot
fit the quota is refused before anything changes. Pure bookkeeping over the sidecar's pin calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool_sidecar.config import KVCachePolicySpec, PinnedPrompt
from kvpool_sidecar.errors import InvalidRequest
from kvpool_sidecar.keys import engine_block_hashes, namespace, namespaced
from kvpool_sidecar.pool import PoolError
from kvpool_sidecar.service.credentials import ADMIN, Principal

log = logging.getLogger("kvpool.sidecar")
MAX_ENGINE_MODELS = 64  # engine model identities whose block hashing the sidecar keeps (the newest)
POLICY = Principal("policy")  # what owns the named prompts' pins (an admin may list and remove them)


@dataclass
class PromptState:
    prompt: PinnedPrompt
    pages: int  # its full pages
    pin_id: str | None = None
    pinned: int = 0  # pages its pin holds
    problem: str = "not saved by an engine yet"  # why it is not wholly pinned ("" when it is)

    def view(self) -> dict[str, Any]:
        return {"name": self.prompt.name, "model": self.prompt.model, "pages": self.pages, "pinned": self.pinned,
                "problem": self.problem or None}


def prompt_pages(spec: KVCachePolicySpec) -> int:
    """The pages a spec's named prompts hold once pinned: the one rule they are counted by."""
    return sum(len(p.tokens) // spec.pageSize for p in spec.pinning.prompts)


def check_prompts_fit(spec: KVCachePolicySpec, total_pages: int) -> None:
    """Refuse a spec whose named prompts exceed its pin quota on a pool of ``total_pages``."""
    quota = int(total_pages * spec.pinning.quotaPercent / 100)
    need = prompt_pages(spec)
    if need > quota:
        raise InvalidRequest(
            f"pinning.prompts: the named prompts fill {need} pages: more than the pin quota of {quota} pages "
            f"(pinning.quotaPercent {spec.pinning.quotaPercent:g} of {total_pages}); raise the quota or name fewer",
            "pinning.prompts",
        )


class PromptPins:
    """Which named prompts are pinned, and the calls that keep them so."""

    def __init__(self) -> None:
        self.states: dict[str, PromptState] = {}

    def configure(self, spec: KVCachePolicySpec, unpin: Callable[[str], None]) -> None:
        """Take a new config's prompts: a removed or changed prompt's pin goes now, the rest stay."""
        fresh = {p.name: p for p in spec.pinning.prompts}
        for name, state in list(self.states.items()):
            if fresh.get(name) != state.prompt:
                self._drop(state, unpin)
                del self.states[name]
        for name, prompt in fresh.items():
            if name not in self.states:
                self.states[name] = PromptState(prompt, len(prompt.tokens) // spec.pageSize)

    def refresh(self, cached_keys: Callable[[PinnedPrompt], tuple[list[Any], int]],
                pin: Callable[[list[Any]], Any], unpin: Callable[[str], None], live: Callable[[str], bool]) -> None:
        """Pin what more of each prompt the engine has saved. ``cached_keys`` gives a prompt's keys in
        the engine identity holding most of it, and how many of its pages are cached."""
        for state in self.states.values():
            if state.pin_id is not None and not live(state.pin_id):  # removed through the API, or lapsed
                state.pin_id, state.pinned = None, 0
            if state.pinned == state.pages:
                continue
            try:
                keys, cached = cached_keys(state.prompt)
                if cached <= state.pinned:
                    if cached == 0:
                        state.problem = "not saved by an engine yet"
                    continue
                record = pin(keys)
            except (InvalidRequest, PoolError) as exc:
                if state.problem != str(exc):
                    log.warning("named prompt %s: not pinned: %s", state.prompt.name, exc)
                state.problem = str(exc)
                continue
            self._drop(state, unpin)
            state.pin_id, state.pinned = record.pin_id, len(record.pages)
            state.problem = "" if state.pinned == state.pages else "part of it saved so far"

    def pages_pinned(self) -> dict[str, tuple[int, int]]:
        """Each prompt's pinned pages and its full pages, for the metrics."""
        return {name: (s.pinned, s.pages) for name, s in self.states.items()}

    @staticmethod
    def _drop(state: PromptState, unpin: Callable[[str], None]) -> None:
        if state.pin_id is not None:
            try:
                unpin(state.pin_id)
            except PoolError:
                pass  # gone already
            state.pin_id, state.pinned = None, 0


class EnginePins:
    """The sidecar's half: how each engine model hashes its blocks, and pins by its keys."""

    def learn_engine_hashing(self, model: str, algo: str, seed: str, probe: bytes) -> bool:
        """Remember how the engines of ``model`` hash their blocks once this sidecar computes the same
        hash as the engine's probe (vLLM's own hash of the block of token ids 0..page_size-1)."""
        ps = self.pool.page_size
        try:
            mine = engine_block_hashes(list(range(ps)), ps, algo, seed)
        except InvalidRequest as exc:
            why = str(exc)
        else:
            if mine == [probe]:
                self.engine_hashing.pop(model, None)
                self.engine_hashing[model] = (algo, seed)
                while len(self.engine_hashing) > MAX_ENGINE_MODELS:  # the oldest model first
                    self.engine_hashing.pop(next(iter(self.engine_hashing)))
                return True
            why = "its hash of a probe block differs from the sidecar's (another vLLM hashing scheme?)"
        if model not in self._hashing_refused and len(self._hashing_refused) < MAX_ENGINE_MODELS:
            self._hashing_refused.add(model)
            log.warning("engine model %s: pins by token ids are off for it: %s", model[:200], why)
        return False

    def engine_schemes(self, model: str) -> list[tuple[str, str, str]]:
        """(identity, algo, seed) of each engine model identity ``model`` names whose hashing is known here."""
        return [(m, *self.engine_hashing[m]) for m in list(self.engine_hashing)
                if m == model or m.rsplit("@", 1)[0] == model]

    def adopt_engine_hashing(self, identity: str, algo: str, seed: str) -> None:
        """Take a peer's word for how the engines of ``identity`` hash (a warm-up before this sidecar's own engine
        connected); what an engine of its own says (:meth:`learn_engine_hashing`) stays and replaces it."""
        if identity not in self.engine_hashing and len(self.engine_hashing) < MAX_ENGINE_MODELS:
            self.engine_hashing[identity] = (algo, seed)

    def engine_keys(self, model: str, tokens: list[int]) -> list[list[bytes]]:
        """The pool keys the engines of ``model`` give the full blocks of ``tokens``: one list per model
        identity that ``model`` names (the whole identity, or the engine's ``--model``, a hub name or path,
        before its ``@``, which engines of several tensor-parallel degrees share)."""
        known = [m for m in self.engine_hashing if m == model or m.rsplit("@", 1)[0] == model]
        if not known:
            names = sorted({m.rsplit("@", 1)[0] for m in self.engine_hashing}) or ["none yet"]
            raise InvalidRequest(f"no engine serving model {model!r} has connected to this sidecar (engine models: "
                                 f"{', '.join(n[:200] for n in names)})", "model")
        ps = self.pool.page_size
        return [namespaced(namespace(m), engine_block_hashes(tokens, ps, *self.engine_hashing[m])) for m in known]

    def pin_engine_prompt(self, model: str, tokens: list[int], *, owner: Principal = ADMIN, **kwargs: Any) -> Any:
        """Pin a prompt's cached pages in the engine's key space (the identity holding most of them)."""
        best = max(self.engine_keys(model, tokens), key=lambda keys: len(self.pool.table.cached_prefix(keys)))
        return self.pin(block_hashes=best, owner=owner, **kwargs)

    def keep_prompts_pinned(self) -> None:
        """Pin what more of the policy's named prompts the engines have saved."""
        self.prompts.refresh(self._prompt_keys, lambda keys: self.pin(block_hashes=keys, owner=POLICY),
                             self.unpin_own, lambda pin_id: pin_id in self.pool.pinning.records)

    def _prompt_keys(self, prompt: PinnedPrompt) -> tuple[list[Any], int]:
        # Hashing a long prompt costs milliseconds: once per prompt and set of engine schemes, not per tick.
        seen = (id(prompt), tuple(self.engine_hashing.items()))
        memo = self._prompt_key_memo.get(prompt.name)
        if memo is None or memo[0] != seen:
            memo = (seen, self.engine_keys(prompt.model, prompt.tokens))
            self._prompt_key_memo[prompt.name] = memo
            while len(self._prompt_key_memo) > len(self.prompts.states):  # prompts the config dropped
                self._prompt_key_memo.pop(next(k for k in self._prompt_key_memo if k not in self.prompts.states))
        cached = [(keys, len(self.pool.table.cached_prefix(keys))) for keys in memo[1]]
        return max(cached, key=lambda kc: kc[1])

    def unpin_own(self, pin_id: str) -> None:
        """Remove one of the sidecar's own pins (the policy's named prompts')."""
        self.pool.unpin(pin_id)
        self._forget_pin(pin_id)

