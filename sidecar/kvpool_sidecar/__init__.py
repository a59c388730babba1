"""kvpool sidecar: the data plane that owns one inference pod's paged KV-cache pool."""

__version__ = "0.1.0"
