"""A tiny random-weight Llama and a byte-level BPE tokenizer, built offline (no model hub is needed).

Random weights give meaningless but deterministic tokens: enough to prove that KV loaded from the pool
is the KV the engine would have computed (identical greedy tokens) and that it is really used (altered
pages give other tokens). Used by the engine tests, ``bench/engine.py`` and ``make run``.
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
KV_SHAPE = "2,1,64,float32"  # the sidecar's --kv-shape for this model: layers, kv heads, head dim, dtype
CORPUS = (
    "the quick brown fox jumps over the lazy dog. kvpool keeps the pages that come back. "
    "a system prompt, a chat history, a shared document: prefixes that many requests repeat. "
) * 40


def build_tiny_model(folder: str | Path, *, seed: int = 0, kv_heads: int = 1,
                     layer_types: tuple[str, ...] | None = None, sliding_window: int = 64) -> Path:
    """Write the model and tokenizer to ``folder`` (reused when already there); returns the folder.
    ``kv_heads``: 2 gives each rank of a TP=2 engine a head of its own (the sidecar's --kv-shape then
    names 2 heads; 2 attention heads either way). ``layer_types``: one of ``"full_attention"`` or
    ``"sliding_attention"`` per layer (transformers' and vLLM's Llama field), the sliding ones attending
    to the last ``sliding_window`` tokens: a hybrid model, as Gemma 3 or gpt-oss are."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(folder)
    stamp = out / "kvpool-tiny.json"
    layers = int(KV_SHAPE.split(",")[0])
    wanted = {"layers": layers, "seed": seed, "vocab": VOCAB, "kv_heads": kv_heads,
              "layer_types": list(layer_types or ()), "sliding_window": sliding_window if layer_types else None}
    if layer_types is not None and len(layer_types) != layers:
        raise ValueError(f"layer_types: one per layer ({layers}), got {len(layer_types)}")
    if stamp.exists() and json.loads(stamp.read_text()) == wanted:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=kv_heads, head_dim=64, initializer_range=0.2,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        **({"layer_types": list(layer_types), "sliding_window": sliding_window} if layer_types else {}),
    )
    LlamaForCausalLM(config).save_pretrained(out)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([CORPUS], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps(wanted))
    return out
