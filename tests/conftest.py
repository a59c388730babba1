"""Test-wide setup. The Triton interpreter must be chosen before any kernel module is imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
