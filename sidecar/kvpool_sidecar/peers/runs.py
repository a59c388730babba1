"""Pages as transfer descriptors: each run of pages contiguous on both sides becomes one descriptor (a NIXL
descriptor costs about 2.5 us whatever its size, so 16 KiB pages one by one read at a third of memory speed)."""

from __future__ import annotations


def page_runs(local: list[int], remote: list[int], page_bytes: int, local_base: int,
              remote_base: int) -> list[tuple[int, int, int]]:
    """(local address, remote address, bytes) per run of pages whose ids follow each other on both sides,
    in order; ``local`` and ``remote`` pair up page for page."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local pages for {len(remote)} remote pages")
    out: list[tuple[int, int, int]] = []
    i = 0
    while i < len(local):
        j = i + 1
        while j < len(local) and local[j] == local[j - 1] + 1 and remote[j] == remote[j - 1] + 1:
            j += 1
        out.append((local_base + local[i] * page_bytes, remote_base + remote[i] * page_bytes, (j - i) * page_bytes))
        i = j
    return out
