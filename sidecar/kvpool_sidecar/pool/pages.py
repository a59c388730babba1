"""The page table: per-page state (struct of arrays), the prefix index, the free stack and the tree links.

Plain data with public fields, as vLLM's BlockPool keeps its blocks, and the few methods that keep the
index and the tree consistent; the other parts of the pool (:mod:`.eviction`, :mod:`.pins`,
:mod:`.sequences`) read and write the fields they own by name. Page state lives in parallel lists
indexed by page id: it is what keeps the hot paths free of object allocation and a cached page at a
few hundred bytes (see ``bench/eviction.py`` for the figure per policy). Owns I1 (one state per page),
I2 (the index holds only committed full pages) and I4 (no orphans: an indexed page's parent is indexed).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable

from kvpool_sidecar.policies import NO_PAGE, PageTree
from kvpool_sidecar.pool.records import SeqState


class PageTable:
    """The pages' arrays and the prefix tree of a :class:`~kvpool_sidecar.pool.PagePool`."""

    def __init__(self, n: int) -> None:
        self.total_pages = n
        self.ref = [0] * n  # sequences holding the page (the sequences' page tables own the count)
        self.pins = array("I", bytes(4 * n))  # pins per page, 4 bytes a page (:mod:`.pins` keeps them)
        self.key: list[Hashable | None] = [None] * n
        self.parent = [NO_PAGE] * n
        self.first_child = [NO_PAGE] * n
        self.next_sib = [NO_PAGE] * n
        self.prev_sib = [NO_PAGE] * n
        self.part = bytearray(n)  # partition index per page: a byte, not a list's 8
        self.last = [0.0] * n  # when a sequence last held it (released or hit)
        self.expires = [0.0] * n  # when its reuse window ends: set at release (:meth:`.Eviction.release`)
        self.user: list[str] = [""] * n  # who first computed the page (cross-user reuse)
        self.klass: list[Hashable] = [None] * n  # statistics class of the request that last released it
        self.reused = bytearray(n)  # 1: a request hit the page since it was last handed out (reuse evidence)
        self.index: dict[Hashable, int] = {}
        self.free = list(range(n - 1, -1, -1))  # a stack: page 0 is handed out first
        self.in_use = 0  # pages with refcount > 0
        # Keys that left the index, in order, while someone follows them (the engine's KV events:
        # the sidecar drains this list under the pool's lock); None: nobody does, nothing is kept.
        self.removed_keys: list[Hashable] | None = None

    def tree(self) -> PageTree:
        """The tree links, for the policies that walk them."""
        return PageTree(self.parent, self.first_child, self.next_sib)

    def cached_prefix(self, keys: list[Hashable]) -> list[int]:
        index = self.index
        hits: list[int] = []
        for key in keys:
            page = index.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    def publish_fresh(self, pages: list[int], start: int, keys: list[Hashable], user: str) -> None:
        """Index ``pages[start:start + len(keys)]`` under ``keys``, none of which is indexed yet."""
        new_pages = pages[start : start + len(keys)]
        self.index.update(zip(keys, new_pages, strict=True))
        key_of = self.key
        user_of = self.user
        parent_of = self.parent
        first_child = self.first_child
        # The first page may join siblings under a published parent; each later one is the only
        # child of the page before it, which nobody else could reach (it was not indexed).
        parent = pages[start - 1] if start else NO_PAGE
        page = new_pages[0]
        key_of[page] = keys[0]
        user_of[page] = user
        parent_of[page] = parent
        if parent != NO_PAGE:
            head = first_child[parent]
            if head != NO_PAGE:
                self.next_sib[page] = head
                self.prev_sib[head] = page
            first_child[parent] = page
        for i in range(1, len(new_pages)):
            parent = page
            page = new_pages[i]
            key_of[page] = keys[i]
            user_of[page] = user
            parent_of[page] = parent
            first_child[parent] = page

    def publish_contended(self, seq: SeqState, upto: int) -> None:
        """Publish up to page ``upto`` when some keys are indexed already: by a fork sibling (the
        same page, nothing to do) or by another sequence, which blocks ours from there on."""
        index = self.index
        pages = seq.pages
        for i in range(seq.published, upto):
            page = pages[i]
            holder = index.get(seq.keys[i])
            if holder is None:
                self.publish_fresh(pages, i, [seq.keys[i]], seq.meta.user)
            elif holder != page:
                # Ours stays private (freed on release), and so do the pages after it, whose parent
                # would not be ours.
                seq.publish_blocked = True
                seq.published = i
                return
        seq.published = upto

    def unlink(self, page: int) -> None:
        parent = self.parent[page]
        if parent == NO_PAGE:
            return
        prev, nxt = self.prev_sib[page], self.next_sib[page]
        if prev != NO_PAGE:
            self.next_sib[prev] = nxt
        else:
            self.first_child[parent] = nxt
        if nxt != NO_PAGE:
            self.prev_sib[nxt] = prev
        self.parent[page] = self.prev_sib[page] = self.next_sib[page] = NO_PAGE

    def forget(self, page: int) -> None:
        """Take a cached page out of the index and the tree and free it."""
        k = self.key[page]
        del self.index[k]
        if self.removed_keys is not None:
            self.removed_keys.append(k)
        self.key[page] = None
        self.unlink(page)
        self.free.append(page)

    def depth(self, page: int) -> int:
        depth = 0
        while self.parent[page] != NO_PAGE:
            page = self.parent[page]
            depth += 1
        return depth

    def check(self) -> set[int]:
        """I1, I2 and I4 from scratch (refcounts are the pool's: they need the page tables); returns
        the free pages."""
        n = self.total_pages
        free_set = set(self.free)
        assert len(free_set) == len(self.free), "I1: a page is on the free stack twice"
        for page in range(n):
            key = self.key[page]
            in_free = page in free_set
            states = (in_free, self.ref[page] > 0, self.ref[page] == 0 and key is not None)
            assert sum(states) == 1, f"I1: page {page} is in {sum(states)} states"
            if in_free:
                assert key is None, f"I1: free page {page} has a key"
            elif key is not None:
                assert self.index.get(key) == page, f"I2: index does not map page {page}'s key to it"
                parent = self.parent[page]
                assert parent == NO_PAGE or self.key[parent] is not None, f"I4: page {page} is an orphan"
            child = self.first_child[page]
            while child != NO_PAGE:
                assert self.parent[child] == page, f"I4: tree link of page {child} is broken"
                child = self.next_sib[child]
        assert len(self.index) == sum(1 for k in self.key if k is not None), "I2: index size"
        return free_set
