"""Every recipe and every option of every config group composes, type-checks and instantiates offline.

1. ``conf/config.yaml`` + each ``conf/recipe/*.yaml`` (whatever recipes exist) composes against the
   schemas (``rlhf_train.config.schema``), passes ``components.validate_config``, and its PPO components
   (tokenizer, policy, reference, reward model, KL controller, prompts, optimizer, transform stack) are
   built when the recipe runs PPO (``stage`` ``ppo`` or ``pipeline``). Pieces that need the Hugging Face Hub (TL;DR recipes: ``gpt2``, the TL;DR dataset) are swapped
   for tiny local stand-ins first; the rest of the recipe is used as written.
2. ``conf/config.yaml`` with each option of each group composes and passes ``validate_config``; the
   option is instantiated where that needs no network (hub names must fail at once, naming the key).
3. Bad values fail at start naming the key.

Budget: ~20 s on 2 CPU cores (the tokenizer and the review split are built once, then cached).
"""
import os
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from rlhf_train.infra.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
# the config groups of the primary config's defaults list, and their options
GROUPS = [next(iter(d)) for d in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"] if isinstance(d, dict)]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def compose(overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf_train.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return hydra_compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def is_hub_name(value) -> bool:
    return bool(value) and not os.path.isdir(os.path.expanduser(str(value)))


def standins(cfg) -> list[str]:
    """Overrides that replace the hub-only pieces of a composed config with tiny local ones."""
    out = []
    if cfg.tokenizer.get("pretrained") and is_hub_name(cfg.tokenizer.pretrained):
        out.append("tokenizer=movie_reviews_bpe")
    policy = cfg.policy
    if is_hub_name(policy.get("pretrained")) or not (policy.get("pretrained") or policy.get("config")):
        out += ["policy=tiny_gpt2", "policy.pretrained=null"]  # a hub model, or one an earlier stage makes
    if is_hub_name(cfg.ref_model.get("pretrained")):
        out.append("ref_model.pretrained=null")
    rm = cfg.reward_model
    if OmegaConf.is_missing(rm, "pretrained") or is_hub_name(rm.get("pretrained")) or not (rm.get("pretrained") or rm.get("config")):
        out += ["reward_model=tiny_gpt2", "reward_model.pretrained=null"]  # likewise
    if cfg.data.get("dataset") and is_hub_name(cfg.data.dataset):
        out.append("data=synthetic")
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from hydra.utils import instantiate

    return instantiate(compose().tokenizer)


def test_groups_and_recipes_found():
    assert {"tokenizer", "policy", "ref_model", "reward_model", "kl_controller", "transforms", "data", "rollout",
            "ppo", "optimizer", "scheduler", "trainer", "logger"} <= set(GROUPS)
    assert "smoke" in RECIPES


# --------------------------------------------------------------------------- 1. recipes
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_instantiates(recipe, tmp_path):
    from hydra.utils import instantiate

    from rlhf_train.loop.components import (
        build_components,
        make_lr_scheduler,
        validate_config,
    )
    from rlhf_train.rewards.transforms import build_transform_stack

    cfg = compose([f"+recipe={recipe}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    validate_config(cfg)
    if cfg.stage in ("sft", "rm"):
        return  # a single non-PPO stage: its own models are built by rlhf_train.pipeline.run (tested there)
    overrides = standins(cfg)
    if overrides:
        cfg = compose([f"+recipe={recipe}", *overrides])
        validate_config(cfg)
    comps = build_components(cfg)
    assert len(comps.dataset) >= cfg.data.batch_size
    optimizer = instantiate(OmegaConf.to_container(cfg.optimizer, resolve=True), params=comps.policy.parameters())
    make_lr_scheduler(cfg, optimizer, 10)
    stack = build_transform_stack(cfg.transforms, ref_log_prob_fn=lambda *a: None, eos_token_id=0)
    assert len(stack.transforms) > 0


# --------------------------------------------------------------------------- 2. every option of every group
@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_group_option_composes(group, option, tokenizer, tmp_path):
    from hydra.utils import instantiate

    from rlhf_train.loop.components import (
        build_components,
        make_lr_scheduler,
        validate_config,
    )
    from rlhf_train.rewards.transforms import build_transform_stack

    cfg = compose([f"{group}={option}"])
    node = cfg[group]
    validate_config(cfg)

    def expect_config_error_or(build, key):
        """A hub name must either be in the local cache or fail at once with the key to override."""
        from hydra.errors import InstantiationException

        try:
            return build()
        except (ConfigError, InstantiationException) as err:
            cause = err
            while cause is not None and not isinstance(cause, ConfigError):
                cause = cause.__cause__
            assert cause is not None and key in str(cause), err

    if group == "tokenizer":
        expect_config_error_or(lambda: instantiate(node), "tokenizer.pretrained")
    elif group == "policy":
        if option == "gpt2":
            expect_config_error_or(lambda: instantiate(node, tokenizer=tokenizer), "policy.pretrained")
        else:
            policy = instantiate(node, tokenizer=tokenizer)
            assert policy.lm.config.vocab_size == len(tokenizer)
    elif group == "ref_model":
        policy = instantiate(compose(["policy=tiny_gpt2"]).policy, tokenizer=tokenizer)
        ref = instantiate(node, policy=policy, tokenizer=tokenizer, device=None)
        assert not any(p.requires_grad for p in ref.parameters())
    elif group == "reward_model":
        if node.get("config"):
            rm = instantiate(node, tokenizer=tokenizer, device=None)
            ids = torch.tensor([[5, 6, 7]])
            rewards, end = rm(ids, torch.ones_like(ids))
            assert rewards.shape == (1, 3) and end.shape == (1,)
        else:  # the weights come from elsewhere (the rm stage, a path): without them, fail at start
            with pytest.raises(ConfigError, match="reward_model.pretrained"):
                build_components(compose([f"{group}={option}", "+recipe=smoke", f"{group}={option}"]))
    elif group == "kl_controller":
        controller = instantiate(node)
        assert controller.update([1.0, 2.0]) > 0
    elif group == "transforms":
        assert len(build_transform_stack(node).transforms) > 0
    elif group == "data":
        if node.get("dataset") and is_hub_name(node.dataset):
            pytest.skip("a hub dataset: tests never touch the network")
        kwargs = {k: v for k, v in node.items() if k not in ("batch_size", "num_workers")}
        data = instantiate(kwargs, tokenizer=tokenizer)
        assert len(data) >= node.batch_size and data[0]["input_ids"].shape == data[0]["attention_mask"].shape
    elif group == "optimizer":
        params = [torch.nn.Parameter(torch.zeros(2))]
        instantiate(OmegaConf.to_container(node, resolve=True), params=params).step()
    elif group == "scheduler":
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
        scheduler = make_lr_scheduler(cfg, optimizer, 10)
        optimizer.step()
        scheduler.step()
    elif group == "logger":
        if node.kind == "wandb":
            return  # composes; building it would start W&B (network or offline files)
        from rlhf_train.infra.logger import build_logger

        logger = build_logger(node, tmp_path, {})
        logger.log({"objective/score": 1.0}, 1)
        logger.finish()
    # rollout, ppo, trainer: plain values, checked by the schema and validate_config above


# --------------------------------------------------------------------------- 3. bad values
@pytest.mark.parametrize("override, key", [
    ("ppo.nonexistent=1", "ppo.nonexistent"),
    ("ppo.clip_eps=abc", "ppo.clip_eps"),
    ("rollout.top_k=1.5", "rollout.top_k"),
    ("transforms.kl.estimatr=k3", "transforms.kl.estimatr"),
])
def test_bad_override_fails_at_compose(override, key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose(["+recipe=smoke", override])
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("override, key", [
    ("transforms.kl.estimator=k4", "transforms.kl.estimator"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("ppo.minibatch_size=3", "ppo.minibatch_size"),  # with gradient_accumulation_steps=2 below
    ("~transforms.kl", "transforms.reward"),  # the reward entry reads the KL nobody writes any more
    ("~transforms.reward", "transforms.reward"),  # nothing writes the per-token reward
    ("+transforms.extra={_target_:rlhf_train.rewards.transforms.NoSuchTransform}", "transforms.extra"),
])
def test_bad_value_fails_validation(override, key):
    from rlhf_train.loop.components import validate_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_config(compose(["+recipe=smoke", "ppo.gradient_accumulation_steps=2", override]))
