# The compiled frequency-sketch loop (_sketch.c); its reference is kvpool_sidecar.frequency._count_python.
from collections.abc import Hashable, Sequence

def count(cells: bytearray, line_mask: int, keys: Sequence[Hashable], cap: int,
          drop: int) -> tuple[list[int], list[int]]: ...
