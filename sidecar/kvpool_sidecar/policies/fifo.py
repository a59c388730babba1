"""FIFO and S3-FIFO: queue positions fixed at first caching; a hit does not move a page.

Both keep every cached page in their queues, evictable or not, so that a page reused by a running
request (or pinned) keeps its place; ``held`` marks the pages that may not be evicted right now.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import PolicyBase, PolicyContext


class FIFOPolicy(PolicyBase):
    name = "fifo"

    def __init__(self, ctx: PolicyContext | None = None) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()
        self._held: set[int] = set()

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        held = self._held
        queue = self._queue
        # First in is first cached: a prompt's pages are cached head first (at commit), so they queue
        # head first, whatever order the pool releases them in.
        for page in reversed(pages):
            if page in queue:
                held.discard(page)
            else:
                queue[page] = None

    def take(self, page: int, now: float, hit: bool) -> None:
        self._held.add(page)

    def evict(self, page: int) -> None:
        del self._queue[page]

    def peek(self, now: float) -> int:
        held = self._held
        for page in self._queue:
            if page not in held:
                return page
        raise LookupError("no evictable page")

    def victim(self, now: float) -> int:
        if not self._held:
            return self._queue.popitem(last=False)[0]
        page = self.peek(now)
        del self._queue[page]
        return page

    def configure(self, spec: KVCachePolicySpec) -> None:
        pass

    def __len__(self) -> int:
        return len(self._queue) - len(self._held)

    def __contains__(self, page: int) -> bool:
        return page in self._queue and page not in self._held


class S3FIFOPolicy(PolicyBase):
    """S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO and a ghost of keys.

    New pages enter the small queue (10 %); leaving it, a page that was reused moves to the main
    queue, others are evicted and remembered in the ghost; a ghost hit enters main directly. Main is
    a FIFO with reinsertion of reused pages (frequency capped at 3).
    """

    name = "s3fifo"
    SMALL_SHARE = 0.1
    MAX_FREQ = 3

    def __init__(self, ctx: PolicyContext) -> None:
        self._key_of = ctx.key_of
        self._small: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self._freq: dict[int, int] = {}
        self._held: set[int] = set()

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        for page in pages:
            if page in self._freq:
                self._held.discard(page)
                continue
            self._freq[page] = 0
            key = self._key_of(page)
            if key in self._ghost:
                del self._ghost[key]
                self._main[page] = None
            else:
                self._small[page] = None

    def take(self, page: int, now: float, hit: bool) -> None:
        self._held.add(page)
        if hit:
            self._freq[page] = min(self._freq[page] + 1, self.MAX_FREQ)

    def evict(self, page: int) -> None:
        del self._freq[page]
        self._small.pop(page, None)
        self._main.pop(page, None)

    def _remember(self, page: int) -> None:
        self._ghost[self._key_of(page)] = None
        while len(self._ghost) > len(self._freq) + 1:
            self._ghost.popitem(last=False)

    def peek(self, now: float) -> int:
        """Do S3-FIFO's deferred work (promotions, reinsertions) until a queue head is the victim."""
        small, main, freq, held = self._small, self._main, self._freq, self._held
        cycled = 0
        while True:
            # After a full lap of main finds only held pages, the evictable page must be in small.
            if small and (len(small) >= self.SMALL_SHARE * len(freq) or cycled > len(main)):
                page = next(iter(small))
                if freq[page] > 0 or page in held:
                    del small[page]
                    main[page] = None
                    freq[page] = 0
                    continue
                return page
            page = next(iter(main))
            cycled += 1
            if page in held or freq[page] > 0:
                if page not in held:
                    freq[page] -= 1
                main.move_to_end(page)
                continue
            return page

    def victim(self, now: float) -> int:
        page = self.peek(now)
        if page in self._small:
            del self._small[page]
        else:
            del self._main[page]
        del self._freq[page]
        self._remember(page)
        return page

    def configure(self, spec: KVCachePolicySpec) -> None:
        pass

    def __len__(self) -> int:
        return len(self._freq) - len(self._held)

    def __contains__(self, page: int) -> bool:
        return page in self._freq and page not in self._held
