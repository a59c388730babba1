"""kvpool operator: reconciles KVCachePolicy resources into sidecar config."""
