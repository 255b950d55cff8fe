"""LoRA through peft, with the reference for free (issue 15).

On a tiny GPT-2 (Conv1D layers) and a tiny Llama (nn.Linear layers, loaded from a dir): no reference
copy is built (the rollout's reference is the policy's own LM, under ``disable_adapter()``), the first
iteration's KL is exactly 0, only adapter and value-head parameters change, resume from a LoRA
checkpoint gives identical metrics, and the merged export generates the same tokens as the adapter model
under greedy decoding. Bad ``policy.lora`` values get one line before any work.

Budget: ~15 s on 2 quiet CPU cores.
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers.reliability import make_cfg

LORA = ["policy.lora.r=4", "policy.lora.alpha=8", "logger=none", "trainer.checkpoint_every=1000"]
# a 32-token word-level tokenizer and a reward model paying token 7 (tests/e2e/test_train.py): any architecture
STAND_INS = ["tokenizer._target_=tests.e2e.test_train.tiny_tokenizer",
             "reward_model._target_=tests.e2e.test_train.TokenCountRewardModel",
             "data=synthetic", "data.batch_size=4", "data.min_prompt_tokens=2", "data.max_prompt_tokens=4",
             "data.max_prompts=16"]


def _train_capturing_initial(cfg, run_dir, monkeypatch):
    """``train(cfg)``, with a copy of the policy's state dict as built (before any update)."""
    from rlhf_train.loop import trainer

    initial: dict[str, torch.Tensor] = {}
    real_build = trainer.build_run

    def build(*args, **kwargs):
        run = real_build(*args, **kwargs)
        initial.update({k: v.detach().clone() for k, v in run.policy.state_dict().items()})
        return run

    monkeypatch.setattr(trainer, "build_run", build)
    return trainer.train(cfg, run_dir), initial


def _check_lora_run(out, initial):
    from peft import PeftModel

    policy, rollout = out["policy"], out["rollout"]
    assert isinstance(policy.lm, PeftModel)
    # the first iteration's KL is exactly 0: policy and reference are the same weights, scored by the same code
    assert out["history"][0]["objective/kl"] == 0.0
    # no reference copy in memory: the rollout's reference *is* the policy's LM (the same parameter tensors)
    assert rollout.reference.kind == "adapter_off" and rollout.reference.model is policy.lm
    # only the adapter and the value head changed (and both did); every base weight is bit for bit the same
    final = policy.state_dict()
    changed = {k for k, v in final.items() if not torch.equal(v, initial[k])}
    assert changed and all("lora_" in k or k.startswith("value_head.") for k in changed), changed
    assert any("lora_B" in k for k in changed) and any(k.startswith("value_head.") for k in changed)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)


def test_lora_gpt2_reference_for_free(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    out, initial = _train_capturing_initial(make_cfg(*LORA), tmp_path, monkeypatch)
    _check_lora_run(out, initial)
    assert "no reference copy is built" in caplog.text and "ref_model.* is not used" in caplog.text
    # GPT-2's Conv1D layers: every one got an adapter, with fan_in_fan_out set
    lm = out["policy"].lm
    assert lm.peft_config["default"].fan_in_fan_out
    assert sum("lora_A" in n for n, _ in lm.named_parameters()) == 4 * out["policy"].config.n_layer


@pytest.fixture
def tiny_llama_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      eos_token_id=0, bos_token_id=0, pad_token_id=1, tie_word_embeddings=False)
    path = tmp_path / "tiny_llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_lora_llama_reference_for_free_and_merged_export_generates_the_same(tmp_path, tiny_llama_dir, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = make_cfg(*LORA, *STAND_INS, f"policy.pretrained={tiny_llama_dir}", "trainer.num_iterations=2",
                   "optimizer.lr=3e-2")  # a large step: the adapter must visibly change the greedy tokens
    out, initial = _train_capturing_initial(cfg, tmp_path / "run", monkeypatch)
    _check_lora_run(out, initial)
    lm = out["policy"].lm
    assert {m.split(".")[-1] for m in lm.peft_config["default"].target_modules} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear, no lm_head

    export = tmp_path / "run" / "policy"
    prompts = torch.tensor([[5, 9, 3, 12], [1, 1, 7, 20]])
    mask = (prompts != 1).long()
    greedy = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=1, eos_token_id=None)
    with torch.no_grad():
        adapter_tokens = lm.generate(input_ids=prompts, **greedy)
        merged_tokens = AutoModelForCausalLM.from_pretrained(export).generate(input_ids=prompts, **greedy)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        base_tokens = base.generate(input_ids=prompts, **greedy)
        reloaded_tokens = PeftModel.from_pretrained(base, export / "adapter").generate(input_ids=prompts, **greedy)
    assert torch.equal(merged_tokens, adapter_tokens) and torch.equal(reloaded_tokens, adapter_tokens)
    assert not torch.equal(base_tokens, adapter_tokens)  # the adapter learned something the test can see

    # on request, any checkpoint (the adapter) as the same merged export: `python -m rlhf_train.tools.export`
    from safetensors.torch import load_file

    from rlhf_train.tools.export import main

    assert main([str(tmp_path / "run" / "checkpoints" / "iter_000002"), str(tmp_path / "exported")]) == 0
    for name in ("model.safetensors", "value_head.safetensors", "adapter/adapter_model.safetensors"):
        ours, theirs = load_file(tmp_path / "exported" / name), load_file(export / name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_lora_with_a_critic_free_algorithm(tmp_path):
    """GRPO (a reference in the loss, no value head): the same reference for free, first KL exactly 0."""
    from rlhf_train.loop.trainer import train

    out = train(make_cfg(*LORA, "algorithm=grpo", "rollout.num_samples=2", "trainer.num_iterations=1"), tmp_path)
    assert out["history"][0]["objective/kl"] == 0.0 and out["rollout"].reference.model is out["policy"].lm
    assert out["rollout"].reference.kind == "adapter_off" and out["policy"].value_head is None
    assert (tmp_path / "policy" / "adapter" / "adapter_model.safetensors").is_file()


def test_lora_resume_gives_identical_metrics(tmp_path):
    from rlhf_train.loop.trainer import train

    overrides = [*LORA, "trainer.num_iterations=3", "trainer.checkpoint_every=1", "trainer.keep_checkpoints=0"]
    reference = train(make_cfg(*overrides), tmp_path / "reference")["history"]
    ckpt = tmp_path / "reference" / "checkpoints" / "iter_000001"
    assert (ckpt / "policy" / "adapter_model.safetensors").is_file()  # the adapter (peft's format), not the model
    assert not (ckpt / "policy" / "model.safetensors").exists()
    resumed = train(make_cfg(*overrides, f"trainer.resume={ckpt}"), tmp_path / "resumed")["history"]

    def strip(h):
        return {k: v for k, v in h.items() if not k.startswith("time/")}

    assert [h["iteration"] for h in resumed] == [1, 2, 3]  # iteration 1 comes from the checkpoint's history
    assert [strip(h) for h in resumed] == [strip(h) for h in reference]


def test_lora_checkpoint_into_full_finetuning_is_one_line(tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.trainer import train

    train(make_cfg(*LORA, "trainer.num_iterations=1"), tmp_path / "lora")
    ckpt = tmp_path / "lora" / "checkpoints" / "iter_000001"
    with pytest.raises(ConfigError, match=r"holds a LoRA adapter, but policy\.lora\.r is 0"):
        train(make_cfg("logger=none", "trainer.num_iterations=2", f"trainer.resume={ckpt}"), tmp_path / "full")
    # its base model was built from policy.config (not saved): the export tool says where the merged model is
    from rlhf_train.tools.export import export_checkpoint

    with pytest.raises(ConfigError, match=r"built from policy\.config .*<run dir>/policy/"):
        export_checkpoint(ckpt, tmp_path / "exported")


@pytest.mark.parametrize("override, message", [
    ("policy.lora.r=-1", r"policy\.lora\.r=-1 must be >= 0"),
    ("policy.lora.alpha=0", r"policy\.lora\.alpha=0 must be positive"),
    ("policy.lora.dropout=1.5", r"policy\.lora\.dropout=1\.5 must be in \[0, 1\)"),
    ("policy.lora.target_modules=[nope]", r"policy\.lora\.target_modules: nope match no module of this model"),
    ("ref_model.ray_service.enabled=true", r"ray_service\.enabled=true: with policy\.lora\.r>0"),
])
def test_bad_lora_settings_are_one_line(override, message):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_config
    from rlhf_train.models.policy import build_policy

    cfg = make_cfg("policy.lora.r=4", override)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)  # before any work
        build_policy(config={"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 32}, lora=cfg.policy.lora)


@pytest.mark.parametrize("lora, message", [
    # peft refuses a list that matches nothing, but skips a name that matches nothing beside one that does
    ({"r": 4, "target_modules": ["c_attn", "nonexistent"]},
     r"policy\.lora\.target_modules: nonexistent match no module of this model; its linear layers are c_attn, "
     r"c_fc, c_proj, lm_head \(or use all-linear\)$"),
    # an adapter B A on a layer of width 16 has rank <= 16: a larger r is memory for nothing
    ({"r": 17}, r"policy\.lora\.r=17 exceeds the width of the adapted layer transformer\.h\.0\.attn\.c_attn \(16 in, "
                r"48 out\): its adapter has rank at most 16; choose policy\.lora\.r <= 16$"),
    ({"r": 17, "target_modules": ["c_fc"]}, r"policy\.lora\.r=17 exceeds the width of the adapted layer "
                                            r"transformer\.h\.0\.mlp\.c_fc \(16 in, 64 out\)"),
])
def test_lora_names_and_rank_must_fit_the_model(lora, message):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.models.policy import build_policy

    tiny = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 32}
    with pytest.raises(ConfigError, match=message):
        build_policy(config=tiny, lora=lora)
    build_policy(config=tiny, lora={**lora, "r": 16, "target_modules": ["c_attn", "c_fc"]})  # what fits, builds


def test_sft_stage_trains_a_lora_adapter_and_saves_the_merged_model(tmp_path):
    from hydra.utils import instantiate
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_train.models.loading import build_causal_lm
    from rlhf_train.pipeline.sft import train_sft

    init, out = tmp_path / "init", tmp_path / "sft"
    cfg = make_cfg("sft=sentiment", f"sft.init={init}", "sft.lora.r=4", "sft.max_steps=6", "sft.eval_every=6",
                   "sft.batch_size=8", "sft.max_len=24", "sft.max_train_examples=64", "sft.max_eval_examples=16",
                   "sft.warmup_steps=0", "sft.lr=1e-2", "sft.dropout=0.0")
    tokenizer = instantiate(cfg.tokenizer)
    torch.manual_seed(0)
    build_causal_lm(None, {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}, tokenizer).save_pretrained(init)
    info = train_sft(cfg, tokenizer, out)
    assert info["history"][-1]["val/loss"] < info["history"][0]["val/loss"]
    base, merged = AutoModelForCausalLM.from_pretrained(init), AutoModelForCausalLM.from_pretrained(out)
    # only the adapted linear layers changed (merged into them); embeddings and norms are the base's
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])}
    assert changed and all(k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) for k in changed), changed
    ids = torch.tensor([[5, 9, 3, 12, 40, 7]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, out / "adapter")(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, adapted, atol=1e-5)


def test_sft_stage_with_lora_on_a_tied_lm_head_saves_what_it_trained(tmp_path):
    """GPT-2 ties lm_head to the input embedding: merging the head's adapter must not change the embedding."""
    from hydra.utils import instantiate
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhf_train.models.loading import build_causal_lm
    from rlhf_train.pipeline.sft import train_sft

    init, out = tmp_path / "init", tmp_path / "sft"
    cfg = make_cfg("sft=sentiment", f"sft.init={init}", "sft.lora.r=4", "sft.lora.target_modules=[c_attn,lm_head]",
                   "sft.max_steps=4", "sft.eval_every=4", "sft.batch_size=8", "sft.max_len=24",
                   "sft.max_train_examples=32", "sft.max_eval_examples=8", "sft.warmup_steps=0", "sft.lr=1e-2",
                   "sft.dropout=0.0")
    tokenizer = instantiate(cfg.tokenizer)
    torch.manual_seed(0)
    build_causal_lm(None, {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}, tokenizer).save_pretrained(init)
    train_sft(cfg, tokenizer, out)
    base, merged = AutoModelForCausalLM.from_pretrained(init), AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 9, 3, 12, 40, 7]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, out / "adapter")(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, adapted, atol=1e-5)


def test_sft_lora_needs_a_pretrained_init(tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.pipeline.sft import train_sft

    cfg = make_cfg("sft=sentiment", "sft.init=null", "sft.lora.r=4")
    with pytest.raises(ConfigError, match=r"sft\.lora\.r>0 .* sft\.init is null"):
        train_sft(cfg, None, tmp_path)
