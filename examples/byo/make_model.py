"""Builds the worked example's small local models (docs/bring-your-own.md):

    python examples/byo/make_model.py OUT_DIR

* ``OUT_DIR/policy``: a 2-layer Llama-architecture causal LM (random weights, ~0.5 M parameters) with a
  byte-level BPE tokenizer trained on the example's prompts, a ChatML chat template and two EOS tokens
  (``<|im_end|>`` ends a turn, ``<|endoftext|>`` the text), in the standard ``save_pretrained`` format;
* ``OUT_DIR/reward_model``: a 1-label ``AutoModelForSequenceClassification`` with its own, different
  tokenizer, standing in for a reward model trained with TRL's ``RewardTrainer`` (rlhf_train re-encodes the
  policy's text for it and renders the chat with its own template).

Nothing here imports rlhf_train: these are the files any Hugging Face user has.
"""
import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

HERE = Path(__file__).resolve().parent
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_tokenizer(texts, vocab_size, chat_template):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, additional_special_tokens=["<|im_start|>"])
    fast.chat_template = chat_template
    return fast


def main(out: Path) -> None:
    torch.manual_seed(0)
    rows = [json.loads(line) for line in (HERE / "prompts.jsonl").read_text().splitlines()]
    texts = [m["content"] for r in rows for m in r["messages"]] + [r["answer"] for r in rows] + [
        "The answer is", "user", "assistant", "system"]
    tok = bpe_tokenizer(texts, 400, CHATML)
    eos = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    policy = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=eos, pad_token_id=tok.pad_token_id,
        bos_token_id=None, tie_word_embeddings=True))
    policy.generation_config.eos_token_id = eos  # a response ends at the first of either
    policy.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")

    rm_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    rm_tok = bpe_tokenizer(texts, 300, rm_template)  # another vocabulary, another template
    rm = AutoModelForSequenceClassification.from_config(LlamaConfig(
        vocab_size=len(rm_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, num_labels=1, pad_token_id=rm_tok.pad_token_id))
    rm.save_pretrained(out / "reward_model")
    rm_tok.save_pretrained(out / "reward_model")
    print(f"policy: {out / 'policy'}\nreward model: {out / 'reward_model'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "byo_models"))
