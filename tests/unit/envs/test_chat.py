"""The chat template's side of an episode: the first prompt with the tools, an environment turn as a token suffix
(the template rendered for the new messages only), and the whole-conversation check that finds template drift."""
from __future__ import annotations

import pytest

from rlhf_train.envs.chat import ChatFormat
from tests.helpers.envs import CHATML, DRIFTING, add, chatml_tokenizer


def test_first_prompt_announces_the_tools():
    tok = chatml_tokenizer()
    chat = ChatFormat(tok, [add])
    ids = chat.prompt_ids([{"role": "user", "content": "2 + 3?"}])
    assert chat.decode(ids) == ("<|im_start|>system\nTools: add<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>\n"
                                "<|im_start|>assistant\n")
    assert ids == tok.apply_chat_template([{"role": "user", "content": "2 + 3?"}], tools=[add],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)


def test_an_environment_turn_is_the_chatml_suffix_after_the_sampled_eos():
    tok = chatml_tokenizer()
    chat = ChatFormat(tok, [add])
    messages = [{"role": "tool", "name": "add", "content": "5"}, {"role": "user", "content": "Higher."}]
    # what ChatML puts after an assistant turn's <|im_end|> (the policy sampled that token), written out by hand
    expected = "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    assert chat.suffix_ids(messages, "<|im_end|>") == tok(expected, add_special_tokens=False)["input_ids"]
    # a turn that ended with another EOS: the template's own end of turn is part of the suffix
    assert chat.decode(chat.suffix_ids(messages, "<|endoftext|>")) == "<|im_end|>" + expected


def test_a_template_without_the_content_cannot_cut_a_suffix():
    tok = chatml_tokenizer(CHATML.replace("{{ m['content'] }}", "{{ m['content'] | length }}"))
    with pytest.raises(ValueError, match="does not render an assistant message's content"):
        ChatFormat(tok).suffix_ids([{"role": "user", "content": "x"}], "<|im_end|>")


def _episode(chat: ChatFormat):
    """A two-turn conversation and its token ids as an episode holds them (prompt, sampled, suffix, sampled)."""
    tok = chat.tokenizer
    first = [{"role": "user", "content": "Guess."}]
    turn1, turn2 = tok.encode("<think>hm</think>I say 5.") + [tok.eos_token_id], tok.encode("I say 7.") + [tok.eos_token_id]
    reply = [{"role": "user", "content": "Higher."}]
    ids = chat.prompt_ids(first) + turn1 + chat.suffix_ids(reply, "<|im_end|>")
    messages = first + [{"role": "assistant", "content": "<think>hm</think>I say 5."}] + reply
    return messages, ids, turn2


def test_template_drift_is_found_by_rendering_the_whole_conversation():
    faithful = ChatFormat(chatml_tokenizer(CHATML))
    messages, ids, turn2 = _episode(faithful)
    assert not faithful.drifted(messages, ids, add_generation_prompt=True)
    done = messages + [{"role": "assistant", "content": "I say 7."}]
    assert not faithful.drifted(done, ids + turn2, add_generation_prompt=False)  # the ids stop at the last EOS
    # this template drops earlier assistant turns' <think> blocks when it renders a conversation (as Qwen3's
    # does): the tokens of the episode are not what the template would show the model
    drifting = ChatFormat(chatml_tokenizer(DRIFTING))
    messages, ids, turn2 = _episode(drifting)
    assert drifting.drifted(messages, ids, add_generation_prompt=True)
    assert drifting.drifted(messages + [{"role": "assistant", "content": "I say 7."}], ids + turn2, False)
    # messages that say other than the ids (here the first answer) are drift too
    messages, ids, _ = _episode(faithful)
    messages[1] = {"role": "assistant", "content": "I say 6."}
    assert faithful.drifted(messages, ids, add_generation_prompt=True)
