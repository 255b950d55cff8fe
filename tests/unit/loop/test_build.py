"""``build_run``: each decision once (the algorithm from the registry, the reference's kind, the backend);
``step`` is one iteration of the loop; ``TrainState`` round-trips through its state dict."""
from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("overrides, kind", [
    ((), "copy"),                                                            # PPO: a frozen copy
    (("policy.lora.r=4",), "adapter_off"),                                   # LoRA: the adapter switched off
    (("algorithm=grpo", "rollout.num_samples=2", "algorithm.beta=0"), None),  # no KL anywhere: no reference
])
def test_the_reference_is_decided_once(overrides, kind, tiny_cfg):
    from rlhf_train.loop.build import build_run

    run = build_run(tiny_cfg(*overrides))
    reference = run.rollout.reference
    assert (reference.kind if reference is not None else None) == kind
    if kind == "adapter_off":
        assert reference.model is run.accelerator.unwrap_model(run.policy).lm


def test_step_is_one_iteration_and_the_state_round_trips(tiny_cfg):
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.state import TrainState
    from rlhf_train.loop.trainer import step

    cfg = tiny_cfg()
    run = build_run(cfg)
    state = TrainState.fresh(run.kl_controller, 0, 0, 3)
    before = float(run.kl_controller.coef)
    metrics, ro = step(run, state, next(iter(run.loader)))
    assert metrics["val/first_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["objective/kl_coef"] == pytest.approx(before)
    assert float(run.kl_controller.coef) == pytest.approx(metrics["objective/kl_coef_next"])  # the controller stepped
    saved = {**state.state_dict(), "iteration": 1, "process": state.process_state_dict()}
    other = TrainState.fresh(run.kl_controller, 0, 0, 3)
    other.load_state_dict(saved, 0, 0)
    assert other.iteration == 1 and other.run_id == state.run_id
    assert torch.equal(other.generator.get_state(), state.generator.get_state())


def test_removed_keys_get_one_line_naming_the_new_one():
    from omegaconf import OmegaConf

    from rlhf_train.config.moved_keys import moved_key_message
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.checks import check_removed_keys

    assert "update.num_epochs" in moved_key_message("ppo.num_epochs=2")
    assert "algorithm.gamma" in moved_key_message("+ppo.gamma=0.9")
    assert "generation=hf_generate" in moved_key_message("rollout.hf_generate=true")
    assert "ref_model.ray_service" in moved_key_message("transforms.ref_logprob.use_ray_service=true")
    assert moved_key_message("update.num_epochs=2") is None
    cfg = OmegaConf.create({"ppo": {"lam": 0.9}, "rollout": {}, "transforms": {}})  # a recipe of the old layout
    with pytest.raises(ConfigError, match=r"ppo\.lam -> algorithm\.lam"):
        check_removed_keys(cfg)


def test_the_dataset_is_built_before_any_model(tmp_path, monkeypatch):
    """A chat dataset with a tokenizer that has no chat template failed only after the policy, the reference
    and the reward model were built; the dataset draws no global RNG, so the weights are the same."""
    import json

    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.loop.build import build_run
    from rlhf_train.models import policy
    from tests.helpers.reliability import make_cfg

    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"w{i}"}]}) + "\n" for i in range(8)))
    monkeypatch.setattr(policy, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    cfg = make_cfg("data=prompts", f"data.dataset={path}")  # smoke's BPE tokenizer: no chat template
    with pytest.raises(ConfigError, match="holds chat messages but the tokenizer has no chat template"):
        build_run(cfg, run_dir=tmp_path / "run")
