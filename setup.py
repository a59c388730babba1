"""The one thing pyproject.toml cannot say without an experimental table: the compiled extensions.

Two hot loops of the default eviction policy in C, each beside the Python it replaces (which stays as
its reference, and runs where no compiler is found: the extensions are optional):
``kvpool_sidecar._sketch`` (the frequency sketch's per-key loop; ``frequency.COMPILED`` says which
runs) and ``kvpool_sidecar._shadow`` (a self-tuner's shadow cache; ``tuning.COMPILED``).
"""

import sys

from setuptools import Extension, setup

# A fused multiply-add rounds once where Python rounds twice: the compiled ranks must be Python's, bit
# for bit, or the shadows break ties differently.
FLAGS = [] if sys.platform == "win32" else ["-ffp-contract=off"]

setup(ext_modules=[
    Extension("kvpool_sidecar._sketch", ["sidecar/kvpool_sidecar/_sketch.c"], optional=True),
    Extension("kvpool_sidecar._shadow", ["sidecar/kvpool_sidecar/_shadow.c"], optional=True,
              extra_compile_args=FLAGS),
])
