"""Engine connectors: how an inference engine uses the sidecar's pool as its second-tier prefix cache.

``vllm`` is vLLM's KV connector (the only module importing vllm); ``scheduler`` and ``worker`` are its
two halves in engine-free terms, over ``link`` (batched, fault-tolerant HTTP) and ``blocks`` (engine
blocks <-> pool pages). See docs/engine.md.
"""
