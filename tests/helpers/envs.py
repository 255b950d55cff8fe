"""Stand-ins for the environment tests: a byte-level BPE tokenizer with a ChatML template (tools and a ``tool``
role), a tiny random Llama whose LM head favours ``<|im_end|>`` (so turns end within a few tokens), a backend that
records what it sampled, and scripted environments."""
from __future__ import annotations

import time

import torch

CHATML = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
          "<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# re-renders the history differently: earlier assistant turns lose their <think> blocks (as Qwen3's template does)
DRIFTING = CHATML.replace("{{ m['content'] }}", "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}"
                                                "{% else %}{{ m['content'].split('</think>')[-1] }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["Guess the number between 1 and 10.", "Higher.", "Lower.", "Correct!", "The answer is 7.",
         "Error: the tool add did not return", '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
         "user assistant tool system Tools", "0123456789 {}[]\":,."]


def chatml_tokenizer(chat_template: str = CHATML):
    """Byte-level BPE (every string encodes; decode inverts encode): ``<|endoftext|>`` 0 (pad), ``<|im_start|>`` 1,
    ``<|im_end|>`` 2 (EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = chat_template
    return fast


def llama_config(tok, eos_bias: float = 4.0) -> dict:
    return {"model_type": "llama", "vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 512, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "bos_token_id": None, "tie_word_embeddings": False}


def favour_eos(lm, eos_id: int, bias: float = 4.0) -> None:
    """A bias on the LM head: ``eos_id`` gets ``+bias`` logits (random weights would rarely end a turn)."""
    head = lm.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos_id] = bias
    lm.set_output_embeddings(biased)


class Recording:
    """A generation backend that keeps every ``Generation`` its inner backend returned (what was sampled)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def generate(self, prompt, prompt_mask, num_samples=1, **kw):
        gen = self.backend.generate(prompt, prompt_mask, num_samples, **kw)
        self.calls.append((prompt.clone(), prompt_mask.clone(), gen))
        return gen


class Scripted:
    """Replies ``Higher.`` to every assistant turn until turn ``turns``, then ends with reward ``turns`` (``vary``:
    plus the last message's length mod 3, so that a group's rewards differ); never ends with ``turns=None`` (for
    the limits). Keeps what it was sent."""

    def __init__(self, turns: int | None = 3, reward_per_step: float | None = None, vary: bool = False):
        self.turns, self.reward_per_step, self.vary, self.seen, self.rows = turns, reward_per_step, vary, [], []

    def reset(self, row):
        self.rows.append(row)
        return [{"role": "user", "content": "Guess the number between 1 and 10."}]

    def step(self, message):
        self.seen.append(message)
        if self.turns is not None and len(self.seen) >= self.turns:
            return None, float(self.turns) + (len(message["content"]) % 3 if self.vary else 0), {}
        return [{"role": "user", "content": "Higher."}], self.reward_per_step, {}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def slow(x: int) -> int:
    """Sleep far past any timeout.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


def broken(x: int) -> int:
    """Raise.

    Args:
        x: anything
    """
    raise ValueError(f"no {x}")


class ScriptedBackend:
    """A generation backend that writes ``texts[k]`` (+ EOS) in every row at its ``k``-th call (the last text after
    that): scripted model turns (tool calls, ``<think>`` blocks), log-probs -1 per token."""

    def __init__(self, tok, texts: list[str]):
        self.tok, self.texts, self.calls = tok, texts, 0

    def generate(self, prompt, prompt_mask, num_samples=1, **kw):
        from rlhf_train.generation.base import Generation

        ids = self.tok.encode(self.texts[min(self.calls, len(self.texts) - 1)]) + [self.tok.eos_token_id]
        self.calls += 1
        response = torch.tensor([ids] * prompt.shape[0] * num_samples)
        return Generation(response, torch.full(response.shape, -1.0), None)


def save_eos_llama(path, tok, eos_logit: float = 5.0, seed: int = 0, favour: tuple[str, ...] = (),
                   favour_logit: float = 4.0, favour_embedding: float = 0.0, **config):
    """A tiny random Llama saved with ``tok`` to ``path`` (a plain model dir) whose turns end within a few tokens:
    every token's embedding shares one direction ``u`` that dominates the final hidden state, and the EOS row of the
    LM head points along ``u`` (its logit is about ``eos_logit``, the others about 0): no LM-head bias needed.
    ``favour``: tokens (single-token strings) whose rows point along ``u`` too, with a logit of about
    ``favour_logit``, and input embeddings that differ from each other by a random direction of norm
    ``favour_embedding`` each; ``config``: keys of the Llama config that differ from :func:`llama_config`'s."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = {**llama_config(tok), **config}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with torch.no_grad():
        u = torch.nn.functional.normalize(torch.randn(cfg["hidden_size"]), dim=0)
        model.get_input_embeddings().weight.add_(u)
        head = model.get_output_embeddings().weight
        head[tok.eos_token_id] = u * eos_logit / cfg["hidden_size"] ** 0.5
        for token in favour:
            head[tok.convert_tokens_to_ids(token)] = u * favour_logit / cfg["hidden_size"] ** 0.5
            v = torch.nn.functional.normalize(torch.randn(cfg["hidden_size"]), dim=0)
            model.get_input_embeddings().weight[tok.convert_tokens_to_ids(token)] += favour_embedding * v
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class Secret:
    """Only the second turn can win, and only with what the first turn told: whatever the policy says first, the
    environment tells it a secret (the row's ``secret``, a one-token word); the episode ends at the second turn,
    paid 1.0 when that answer starts with the secret, else 0.0. A policy that ignores the conversation wins at most
    1 / (number of secrets) of the games."""

    def __init__(self, repeat: int = 1):
        self.repeat = repeat  # the secret is said this many times (a louder signal for a tiny model)

    def reset(self, row):
        self.secret, self.turn = str(row["secret"]), 0
        return [{"role": "user", "content": "Say hi."}]

    def step(self, message):
        self.turn += 1
        if self.turn == 1:
            return [{"role": "user", "content": "Secret: " + " ".join([self.secret] * self.repeat)}], None, {}
        return None, float(message["content"].strip().startswith(self.secret)), {}
