# The compiled frequency-sketch loop (_sketch.c); its reference is tests/sidecar/oracles.py's count_python.
from collections.abc import Hashable, Sequence

def count(cells: bytearray, line_mask: int, keys: Sequence[Hashable], cap: int,
          drop: int) -> tuple[list[int], list[int]]: ...
