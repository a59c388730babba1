"""The one thing pyproject.toml cannot say without an experimental table: the compiled extensions.

Two hot loops of the default eviction policy in C: ``kvpool_sidecar._sketch`` (the frequency
sketch's per-key loop) and ``kvpool_sidecar._shadow`` (a self-tuner's shadow cache). Their Python
references are in tests/sidecar/oracles.py. Installing needs a C compiler (the Dockerfile's wheel
stage has one; the sidecar's image does not).
"""

import sys

from setuptools import Extension, setup

# A fused multiply-add rounds once where Python rounds twice: the compiled ranks must be Python's, bit
# for bit, or the shadows break ties differently.
FLAGS = [] if sys.platform == "win32" else ["-ffp-contract=off"]

setup(ext_modules=[
    Extension("kvpool_sidecar._sketch", ["sidecar/kvpool_sidecar/_sketch.c"]),
    Extension("kvpool_sidecar._shadow", ["sidecar/kvpool_sidecar/_shadow.c"],
              extra_compile_args=FLAGS),
])
