"""Damaged model dirs, in one line: a reward model (the ``reward_model`` group, or a reward model listed under
``rewards.<name>``) or a policy whose dir has a garbled ``config.json``, no weights, a truncated safetensors
file, custom code without ``trust_remote_code``, or NaN weights stops the run with one ``ConfigError``
naming the key, before anything is written; ``build_reward_model`` itself refuses the same dirs.

Budget: ~10 s on 2 CPU cores (tiny GPT-2s; every failure is before training).
"""
from __future__ import annotations

import json

import pytest

from rlhf_train.infra.errors import ConfigError
from tests.helpers.byo import chat_tokenizer, save_seq_classifier
from tests.helpers.reliability import files_of, make_cfg, tiny_policy

RM_FACTORY = "rlhf_train.models.reward_model.build_reward_model"


def _garble(d):
    (d / "config.json").write_text("{not json")


def _no_weights(d):
    (d / "model.safetensors").unlink()


def _truncate(d, name="model.safetensors"):
    data = (d / name).read_bytes()
    (d / name).write_bytes(data[: len(data) // 2])


def _custom_code(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="my_custom_lm", auto_map={"AutoConfig": "modeling_my.MyConfig",
                                                    "AutoModelForSequenceClassification": "modeling_my.MyModel",
                                                    "AutoModelForCausalLM": "modeling_my.MyModel"})
    (d / "config.json").write_text(json.dumps(cfg))


def _nan_weights(d):
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(d / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name].clone().fill_(float("nan"))
    save_file(weights, d / "model.safetensors", metadata={"format": "pt"})
    assert torch.isnan(load_file(d / "model.safetensors")[name]).all()


DAMAGES = {  # name -> (damage, what the one line says)
    "garbled_config": (_garble, r"config\.json is corrupt"),
    "no_weights": (_no_weights, r"holds no weights"),
    "truncated_weights": (_truncate, r"model\.safetensors is damaged"),
    "custom_code": (_custom_code, r"trust_remote_code=true"),
}


def _fails(tmp_path, *overrides, match):
    from rlhf_train.loop.trainer import train

    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    (run / "metrics.csv").write_text("iteration,objective/score\n1,0.5\n")  # an earlier run's output
    before = files_of(run)
    with pytest.raises(ConfigError, match=match) as exc:
        train(make_cfg(*overrides), run)
    assert "\n" not in str(exc.value)
    assert files_of(run) == before and not (run / "checkpoints").exists()
    return str(exc.value)


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("where", ["reward_model", "rewards"])
def test_damaged_reward_model_dir_is_one_line(tmp_path, damage, where):
    rm_dir = save_seq_classifier(chat_tokenizer(), tmp_path / "rm")
    fn, says = DAMAGES[damage]
    fn(rm_dir)
    if where == "reward_model":
        overrides, key = ["reward_model=pretrained", f"reward_model.pretrained={rm_dir}"], r"reward_model\.pretrained"
    else:
        overrides = ["reward_model=none", f"+rewards.judge._target_={RM_FACTORY}", f"+rewards.judge.pretrained={rm_dir}"]
        key = r"rewards\.judge\.pretrained"
    line = _fails(tmp_path, *overrides, match=f"{key}=.*{says}")
    if damage == "custom_code":  # the key to set is the one next to the model's
        assert f"set {key.replace(chr(92), '').rsplit('.', 1)[0]}.trust_remote_code=true" in line


@pytest.mark.parametrize("damage", sorted(DAMAGES) + ["nan_weights", "truncated_head"])
def test_build_reward_model_refuses_a_damaged_dir(tmp_path, damage):
    """The factory itself (what a ``rewards.<name>`` entry or a pipeline calls) gives the same one line."""
    from rlhf_train.models.reward_model import RewardModel, build_reward_model

    if damage == "truncated_head":  # rlhf_train's own RewardModel layout: trunk + reward_head.safetensors
        lm = tiny_policy().lm
        rm_dir = tmp_path / "rm"
        RewardModel(lm.base_model, lm.config.hidden_size).save_pretrained(str(rm_dir))
        _truncate(rm_dir, "reward_head.safetensors")
        fn, says = (lambda d: None), r"reward_head\.safetensors is damaged"
    else:
        rm_dir = save_seq_classifier(chat_tokenizer(), tmp_path / "rm")
        fn, says = DAMAGES[damage] if damage in DAMAGES else (_nan_weights, r"model\.safetensors holds NaN or inf")
    fn(rm_dir)
    with pytest.raises(ConfigError, match=f"rewards\\.x\\.pretrained=.*{says}") as exc:
        build_reward_model(chat_tokenizer(), pretrained=str(rm_dir), override="rewards.x.pretrained")
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("damage", ["truncated_weights", "custom_code", "nan_weights"])
def test_damaged_policy_dir_is_one_line(tmp_path, damage):
    policy_dir = tmp_path / "model"
    tiny_policy().lm.save_pretrained(policy_dir)
    fn, says = DAMAGES[damage] if damage in DAMAGES else (_nan_weights, r"model\.safetensors holds NaN or inf")
    fn(policy_dir)
    _fails(tmp_path, "policy=gpt2", f"policy.pretrained={policy_dir}", match=f"policy\\.pretrained=.*{says}")
