"""Host-side page allocator of one engine's paged KV cache.

Page 0 is reserved as the padding page (block tables are padded with 0, so gathers stay in
bounds) and is never handed out. Each request owns an ordered list of pages: its page table.
"""

from __future__ import annotations

from collections.abc import Hashable


class OutOfPages(RuntimeError):
    """Not enough free pages for an allocation (the caller should wait, evict or park)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: the lowest ids are handed out first (easier to read in tests).
        self._free = list(range(num_pages - 1, 0, -1))
        self._tables: dict[Hashable, list[int]] = {}

    # -- queries -----------------------------------------------------------------------------
    @property
    def pages_total(self) -> int:
        """Allocatable pages (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.pages_total - self.pages_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def table(self, owner: Hashable) -> list[int]:
        if owner not in self._tables:
            raise KeyError(f"request {owner!r} holds no pages")
        return self._tables[owner]

    def owners(self) -> list[Hashable]:
        return list(self._tables)

    def can_hold(self, owner: Hashable | None, num_tokens: int) -> bool:
        """Whether ``owner`` (None: a new request) could grow to ``num_tokens`` tokens now."""
        have = len(self._tables.get(owner, ())) if owner is not None else 0
        return self.pages_for(num_tokens) - have <= self.pages_free

    # -- changes -----------------------------------------------------------------------------
    def ensure(self, owner: Hashable, num_tokens: int) -> list[int]:
        """Grow ``owner``'s page table to hold ``num_tokens`` tokens; returns the table.
        All or nothing: raises :class:`OutOfPages` without allocating when short."""
        table = self._tables.setdefault(owner, [])
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            if not table:
                del self._tables[owner]
            raise OutOfPages(f"request {owner!r} needs {need} more page(s), {len(self._free)} free")
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return table

    def free(self, owner: Hashable) -> int:
        """Return all of ``owner``'s pages; returns how many. Unknown owners raise."""
        table = self._tables.pop(owner, None)
        if table is None:
            raise KeyError(f"request {owner!r} holds no pages (double free?)")
        self._free.extend(reversed(table))
        return len(table)

    def check(self) -> None:
        """Invariant check: every page is free or owned exactly once, page 0 never."""
        owned = [p for t in self._tables.values() for p in t]
        seen = owned + self._free
        if sorted(seen) != list(range(1, self.num_pages)):
            raise AssertionError("page accounting is broken: pages lost or handed out twice")
