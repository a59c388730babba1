"""The one thing pyproject.toml cannot say without an experimental table: the compiled extension.

``kvpool_sidecar._sketch`` is the frequency sketch's per-key loop in C (see the file). Optional:
where no compiler is found the package installs without it and runs the same loop in Python
(``kvpool_sidecar.frequency.NATIVE`` says which).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpool_sidecar._sketch", ["sidecar/kvpool_sidecar/_sketch.c"], optional=True)])
