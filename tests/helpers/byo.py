"""Tiny stand-ins for the bring-your-own tests (issue 13): a word-level tokenizer with a chat template and
two EOS tokens, tiny random models of several architectures built from config and saved to disk."""
from __future__ import annotations

from pathlib import Path

WORDS = [f"w{i}" for i in range(4, 40)] + [str(d) for d in range(10)] + ["user", "assistant", "answer", "is"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


def chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE, extra_words: int = 0):
    """Word-level: ``<|endoftext|>`` 0 (EOS), ``<|pad|>`` 1, ``<|im_start|>`` 2, ``<|im_end|>`` 3, then words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [f"x{i}" for i in range(extra_words)]
    vocab = {"<|endoftext|>": 0, "<|pad|>": 1, "<|im_start|>": 2, "<|im_end|>": 3,
             **{w: i + 4 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    out.chat_template = chat_template
    return out


ARCHS = {  # tiny configs: 1-2 layers, width 32-64
    "gpt2": dict(model_type="gpt2", n_layer=1, n_embd=32, n_head=2, n_positions=128),
    "gpt_neox": dict(model_type="gpt_neox", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128),
    "llama": dict(model_type="llama", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128),
    "gemma": dict(model_type="gemma", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=64, head_dim=16, max_position_embeddings=128),
}


def tiny_config(arch: str, tok):
    from transformers import AutoConfig

    kw = dict(ARCHS[arch])
    return AutoConfig.for_model(kw.pop("model_type"), vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id, **kw)


def save_causal_lm(arch: str, tok, path: Path, seed: int = 0, eos_ids: list[int] | None = None) -> Path:
    """A tiny random causal LM of ``arch`` with ``tok`` saved to ``path`` (generation config: ``eos_ids``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, tok))
    if eos_ids is not None:
        model.generation_config.eos_token_id = eos_ids
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_seq_classifier(tok, path: Path, arch: str = "gpt2", seed: int = 1, with_tokenizer: bool = True) -> Path:
    """A tiny random ``AutoModelForSequenceClassification`` with one label (a trained head stands in)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    cfg = tiny_config(arch, tok)
    cfg.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():  # a head far from any default init: a random head cannot match it by chance
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    if with_tokenizer:
        tok.save_pretrained(path)
    return path
