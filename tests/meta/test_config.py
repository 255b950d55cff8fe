"""Every recipe and every option of every config group composes, type-checks and instantiates offline.

1. ``conf/config.yaml`` alone (generic: no recipe) and with each ``conf/recipe/*.yaml`` (whatever recipes
   exist) composes against the schemas (``rlhf_train.config.schema``), passes
   ``rlhf_train.loop.checks.check_config``, and its run (tokenizer, policy, reference,
   reward model, KL controller, prompts, optimizer, shaping stack: ``build_run``) is built when it runs RL (``stage``
   ``rl`` or ``pipeline``). Pieces that need the Hugging Face Hub (TL;DR: ``gpt2``, the TL;DR dataset)
   are swapped for tiny local stand-ins first; the rest is used as written.
2. ``conf/config.yaml`` with each option of each group composes and passes ``check_config``; the
   option is instantiated where that needs no network (hub names must fail at once, naming the key).
   Groups that are null in the root (``sft``, ``rm``, ``evaluation``) are covered too.
3. The root is generic: it names no movie-review / sentiment option, and ``python -m rlhf_train`` with
   no recipe resolves to the embedded default, ``+recipe=default``; a stage that needs a pipeline group
   left null stops with one error line naming the group.
4. Bad values fail at start naming the key (each dataset's schema holds only the keys its function takes).

Budget: ~25 s on 2 CPU cores (the tokenizer and the review split are built once, then cached).
"""
import os

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from rlhf_train.infra.errors import ConfigError
from tests.helpers import zygote
from tests.helpers.config import CONF, compose

RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
# the config groups of the primary config's defaults list (null ones included), and their options
# (`override hydra/...` entries select Hydra's own options, e.g. the --help page: not groups of ours)
ROOT_DEFAULTS = [d for d in yaml.safe_load((CONF / "config.yaml").read_text())["defaults"]
                 if isinstance(d, dict) and not next(iter(d)).startswith("override ")]
GROUPS = [next(iter(d)) for d in ROOT_DEFAULTS]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# conf/ dirs that are not config groups of the primary config
NOT_GROUPS = {"recipe", "hydra"}  # hydra/: Hydra's own groups (the --help page)


def is_hub_name(value) -> bool:
    return bool(value) and not os.path.exists(os.path.expanduser(str(value))) and not str(value).startswith("pkg://")


def standins(cfg) -> list[str]:
    """Overrides that replace the hub-only pieces of a composed config with tiny local ones."""
    out = []
    # a hub tokenizer, or none (null: the policy's own, which is a hub model or built from config here); an
    # environment's episodes are chats: a local policy (a pkg:// GGUF) keeps its own tokenizer and chat template
    policy = cfg.policy
    own = (cfg.get("env") or {}).get("_target_") and policy.get("pretrained") and not is_hub_name(policy.pretrained)
    if "pretrained" in cfg.tokenizer and (not cfg.tokenizer.pretrained or is_hub_name(cfg.tokenizer.pretrained)) \
            and not own:
        out.append("tokenizer=movie_reviews_bpe")
    if is_hub_name(policy.get("pretrained")) or not (policy.get("pretrained") or policy.get("config")):
        out += ["policy=tiny_gpt2", "policy.pretrained=null"]  # a hub model, or one an earlier stage makes
        if cfg.rollout.max_new_tokens > 32:  # the stand-in's context is 128 tokens (synthetic prompts: <= 64)
            out.append("rollout.max_new_tokens=32")
    if is_hub_name(cfg.ref_model.get("pretrained")):
        out.append("ref_model.pretrained=null")
    rm = cfg.reward_model
    if OmegaConf.is_missing(rm, "pretrained") or is_hub_name(rm.get("pretrained")) or not (rm.get("pretrained") or rm.get("config")):
        # likewise; with the context of the longest first prompts (an environment's: tool instructions, an example)
        out += ["reward_model=tiny_gpt2", "reward_model.pretrained=null", "reward_model.config.n_positions=512"]
    if cfg.data.get("dataset") and is_hub_name(cfg.data.dataset):
        out += ["data=synthetic", f"data.batch_size={cfg.data.batch_size}"]  # same batch: update.minibatch_size fits
        if cfg.get("rewards"):  # reward functions read the hub data's columns (an answer): the stand-in RM scores
            out.append("~rewards")
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from hydra.utils import instantiate

    return instantiate(compose(["tokenizer=movie_reviews_bpe"]).tokenizer)  # the root's is GPT-2's (hub)


def test_groups_and_recipes_found():
    assert {"tokenizer", "policy", "ref_model", "reward_model", "kl_controller", "transforms", "data", "rollout",
            "update", "generation", "optimizer", "scheduler", "trainer", "logger", "sft", "rm", "evaluation"} <= set(GROUPS)
    # every group dir under conf/ is in the root's defaults list, so its options are all tested below
    assert {p.name for p in CONF.iterdir() if p.is_dir()} - NOT_GROUPS == set(GROUPS)
    assert {"smoke", "default"} <= set(RECIPES)


# --------------------------------------------------------------------------- 1. recipes
@pytest.mark.parametrize("recipe", [None, *RECIPES], ids=["root", *RECIPES])
def test_recipe_composes_and_instantiates(recipe, tmp_path):
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.checks import check_config
    from rlhf_train.rewards.shaping import build_shaping

    selected = [f"+recipe={recipe}"] if recipe else []
    cfg = compose(selected)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    check_config(cfg)
    if cfg.stage in ("sft", "rm"):
        return  # a single non-PPO stage: its own models are built by rlhf_train.pipeline.run (tested there)
    overrides = standins(cfg)
    if overrides:
        cfg = compose([*selected, *overrides])
        check_config(cfg)
    run = build_run(cfg)  # every component, the optimizer, the LR schedule and the rollout
    assert len(run.dataset) >= cfg.data.batch_size
    assert len(build_shaping(cfg.transforms, eos_token_id=0)) > 0


# --------------------------------------------------------------------------- 2. every option of every group
@pytest.mark.parametrize("group, option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_group_option_composes(group, option, tokenizer, tmp_path):
    from hydra.utils import instantiate

    from rlhf_train.loop.build import build_run, decide
    from rlhf_train.loop.checks import check_config
    from rlhf_train.loop.components import make_lr_scheduler
    from rlhf_train.rewards.shaping import build_shaping

    # the group algorithms (grpo, rloo, reinforce_pp_baseline) need >= 2 completions per prompt
    cfg = compose([f"{group}={option}", *(["rollout.num_samples=2"] if group == "algorithm" else [])])
    node = cfg[group]
    if group == "data" and "dataset" in list(node.keys()) and OmegaConf.is_missing(node, "dataset"):
        # data=prompts: a tiny JSONL of yours, there before check_config reads it (twice the batch: a dataset
        # without splits holds some out)
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(f'{{"prompt": "a film {i}"}}\n' for i in range(2 * node.batch_size)))
        node.dataset = str(path)
    check_config(cfg)

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
        elif OmegaConf.is_missing(node, "pretrained") or node.pretrained:
            pass  # a path you give, or a real checkpoint (smollm2_135m_instruct: tests/unit/models/test_loading.py)
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
                build_run(compose([f"{group}={option}", "+recipe=smoke", f"{group}={option}"]))
    elif group == "kl_controller":
        controller = instantiate(node)
        assert controller.update([1.0, 2.0]) > 0
    elif group == "transforms":
        assert len(build_shaping(node, eos_token_id=0)) > 0
    elif group == "algorithm":
        algorithm = decide(cfg).algorithm
        assert algorithm.needs_critic == (node.name == "ppo")
    elif group == "generation":  # a backend class or a factory (auto), built over a tiny policy with its keys
        from hydra.utils import get_object

        from rlhf_train.generation.base import GenerationBackend
        from tests.helpers.reliability import tiny_policy

        keys = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
        backend = get_object(node._target_)(tiny_policy(), eos_token_id=0, pad_token_id=1, max_new_tokens=2, **keys)
        assert callable(getattr(backend, "generate", None)), GenerationBackend
    elif group == "data":
        if node.get("dataset") and is_hub_name(node.dataset):
            pytest.skip("a hub dataset: tests never touch the network")
        kwargs = {k: v for k, v in node.items() if k not in ("batch_size", "num_workers")}
        if node._target_.startswith("rlhf_train.envs."):  # an environment's prompts are chats: a chat template
            from tests.helpers.envs import chatml_tokenizer

            tokenizer = chatml_tokenizer()
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
    # rollout, update, trainer, sft, rm, evaluation: plain values, checked by the schema and check_config above


# --------------------------------------------------------------------------- 3. a generic root; the default recipe
def test_root_config_names_no_movie_review_or_sentiment_option():
    root = yaml.safe_load((CONF / "config.yaml").read_text())
    task_words = ("movie", "sentiment", "review", "imdb")
    for entry in ROOT_DEFAULTS:
        (group, option), = entry.items()
        assert not any(w in str(option).lower() for w in task_words), f"conf/config.yaml selects {group}: {option}"
    # no group keys set in the root: every value comes from the selected options
    assert set(root) <= {"defaults", "stage", "cache_dir", "task_name", "rewards", "hydra"}, sorted(root)
    assert root["stage"] == "rl" and not any(w in root["task_name"] for w in task_words)
    assert {group: option for entry in ROOT_DEFAULTS for group, option in entry.items()
            if group in ("sft", "rm", "evaluation")} == {"sft": None, "rm": None, "evaluation": None}
    cfg = compose()
    assert cfg.sft is None and cfg.rm is None and cfg.evaluation is None
    assert (cfg.kl_controller.init_kl_coef, cfg.kl_controller.target, cfg.kl_controller.horizon) == (0.1, 6.0, 10000)
    assert (cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.optimizer.lr) == (50, 1.0, 1e-5)


def test_default_recipe_is_added_only_without_a_recipe():
    from rlhf_train.__main__ import default_recipe_overrides

    assert default_recipe_overrides([]) == ["+recipe=default"]
    assert default_recipe_overrides(["logger=csv", "trainer.num_iterations=2"]) == ["+recipe=default"]
    for given in ("+recipe=smoke", "recipe=smoke", "++recipe=smoke", "+recipe=smoke,tldr_ppo"):
        assert default_recipe_overrides(["logger=csv", given]) == []


def test_entry_point_without_arguments_resolves_to_the_default_recipe():
    """``python -m rlhf_train`` (no argument) selects ``recipe: default``, records it in the overrides
    (``.hydra/overrides.yaml``), and its job config is that of ``+recipe=default``."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = zygote.run(["--cfg", "all"], cwd=CONF.parent, env=env,
                      capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    hydra = printed.pop("hydra")
    assert hydra["runtime"]["choices"]["recipe"] == "default"
    assert hydra["overrides"]["task"] == ["+recipe=default"]
    assert printed == OmegaConf.to_container(compose(["+recipe=default"]))
    assert printed["stage"] == "pipeline" and printed["task_name"] == "sentiment_smollm2"


@pytest.mark.parametrize("stage, overrides, group", [
    ("sft", [], "sft"),
    ("rm", [], "rm"),
    ("rm", ["rm=sentiment", "rm.backbone=sft"], "sft"),
    ("pipeline", [], "rm"),
    ("pipeline", ["reward_model.pretrained=/some/rm", "policy=tiny_gpt2"], "sft"),  # PPO starts from the SFT stage
    ("pipeline", ["reward_model.pretrained=/some/rm"], "evaluation"),  # policy gpt2 and this RM: no SFT, no RM stage
])
def test_stage_needing_a_null_group_names_it(stage, overrides, group, tmp_path):
    from rlhf_train.pipeline.run import run

    cfg = compose([f"stage={stage}", "tokenizer=movie_reviews_bpe", f"cache_dir={tmp_path / 'cache'}", *overrides])
    with pytest.raises(ConfigError, match=rf"^{group} is not set .*{group}=NAME") as err:
        run(cfg, tmp_path / "run")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache").exists()  # nothing was started


# --------------------------------------------------------------------------- 4. bad values
@pytest.mark.parametrize("override, key", [
    ("update.nonexistent=1", "update.nonexistent"),
    ("update.clip_eps=abc", "update.clip_eps"),
    ("rollout.top_k=1.5", "rollout.top_k"),
    ("transforms.kl.estimatr=k3", "transforms.kl.estimatr"),
    ("data.nonexistent=1", "data.nonexistent"),
    ("data.max_prompt_length=64", "data.max_prompt_length"),  # a TL;DR key: not one of movie_review_prompts'
    ("tokenizer.pretrained=gpt2", "tokenizer.pretrained"),  # a pretrained-tokenizer key: not the BPE factory's
])
def test_bad_override_fails_at_compose(override, key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose(["+recipe=smoke", override])
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("data, override, key", [
    ("synthetic", "data.split=test", "data.split"),
    ("synthetic", "data.prompt_baseline=true", "data.prompt_baseline"),
    ("tldr", "data.min_prompt_tokens=4", "data.min_prompt_tokens"),
    ("movie_reviews", "data.dataset=x", "data.dataset"),
])
def test_each_dataset_takes_only_its_own_keys(data, override, key):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as err:
        compose([f"data={data}", override])
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("override, key", [
    ("transforms.kl.estimator=k4", "transforms.kl.estimator"),
    ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
    ("rollout.temperature=0", "rollout.temperature"),
    ("update.minibatch_size=3", "update.minibatch_size"),  # with gradient_accumulation_steps=2 below
    ("~transforms.kl", "transforms.reward"),  # the reward entry reads the KL nobody writes any more
    ("~transforms.reward", "transforms.reward"),  # nothing writes the per-token reward
    ("+transforms.extra={_target_:rlhf_train.compat.torchrl_transforms.NoSuchTransform}", "transforms.extra"),
])
def test_bad_value_fails_validation(override, key):
    from rlhf_train.loop.checks import check_config

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_config(compose(["+recipe=smoke", "update.gradient_accumulation_steps=2", override]))
