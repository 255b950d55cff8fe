"""A tiny GGUF file (Llama architecture, 1 layer, width 16, a 31-token byte-level BPE), written with the ``gguf``
package that ``transformers`` reads GGUF with: converts in about a second, so tests of the GGUF cache never need
the real SmolLM2 file."""
from __future__ import annotations

from pathlib import Path


def write_tiny_gguf(path: Path, seed: int = 0, nan_in: str | None = None) -> Path:
    """Write a tiny Llama GGUF (float32 tensors) to ``path``; ``nan_in``: a tensor name whose first value is NaN."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "ab"]
    V, H, F = len(tokens), 16, 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(1)
    w.add_feed_forward_length(F)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // 2)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,), "output.weight": (V, H),
              "blk.0.attn_norm.weight": (H,), "blk.0.ffn_norm.weight": (H,), "blk.0.ffn_gate.weight": (F, H),
              "blk.0.ffn_up.weight": (F, H), "blk.0.ffn_down.weight": (H, F),
              **{f"blk.0.attn_{n}.weight": (H, H) for n in ("q", "k", "v", "output")}}
    for name, shape in shapes.items():
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if name == nan_in:
            a.flat[0] = np.nan
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
