"""Stand-ins for SmolLM2 in the arithmetic task's tests: a byte-level BPE trained on the task's own prompts (with
a minimal chat template and EOS / pad tokens) and a 1-layer Llama over it, saved as a model dir (seconds)."""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]


def chat_tokenizer(path: Path):
    """A ``PreTrainedTokenizerFast`` of ~300 tokens with :data:`CHAT_TEMPLATE`, saved in ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from rlhf_train.tasks.arithmetic.generator import rows

    texts = [r["prompt"] + " " + r["answer"] for split in ("train", "test") for r in rows(split)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL[0], pad_token=SPECIAL[1],
                                   additional_special_tokens=SPECIAL[2:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def tiny_chat_llama(path: Path) -> Path:
    """A 1-layer width-32 Llama with :func:`chat_tokenizer`, saved in ``path`` (a ``policy.pretrained`` dir)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = chat_tokenizer(path)
    cfg = AutoConfig.for_model("llama", vocab_size=len(tok), num_hidden_layers=1, hidden_size=32,
                               num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                               max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path
