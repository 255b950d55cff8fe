"""Structured-config schemas: dataclasses registered in Hydra's ConfigStore.

Each YAML option of a config group starts with ``defaults: [<group>_schema, _self_]`` (or a more
specific schema: one per prompt dataset and per tokenizer factory, holding exactly the keys that
function takes; or another option of the same group, which it extends), so Hydra type-checks it at
start: an unknown key or a value of the wrong type fails with Hydra's one-line message naming the key,
before any work is done. The meaning of every key is
documented in the YAML files under ``conf/``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rlhf_train.algorithms.configs import AlgorithmConfig, UpdateConfig
from rlhf_train.tasks.arithmetic.schema import ArithmeticDataSchema  # data=arithmetic (each task holds its own)
from rlhf_train.tasks.gsm8k.schema import GSM8KDataSchema  # data=gsm8k
from rlhf_train.config.env_schemas import register as register_env_schemas


# ---------------------------------------------------------------- models
# One schema per tokenizer factory: the keys that function takes (an unknown key fails at start).
@dataclass
class PretrainedTokenizerSchema:  # conf/tokenizer/pretrained.yaml -> rlhf_train.data.tokenizers.pretrained_tokenizer
    _target_: str = "rlhf_train.data.tokenizers.pretrained_tokenizer"
    pretrained: Optional[str] = None  # None: the policy's own tokenizer (policy.pretrained)
    trust_remote_code: bool = False


@dataclass
class MovieReviewsTokenizerSchema:  # conf/tokenizer/movie_reviews_bpe.yaml -> tasks.movie_reviews.tokenizer
    _target_: str = "rlhf_train.tasks.movie_reviews.tokenizer.movie_reviews_tokenizer"
    vocab_size: int = 8192
    cache_dir: Optional[str] = "${cache_dir}"
    seed: int = 0


@dataclass
class LoraSchema:  # policy.lora -> rlhf_train.models.lora.apply_lora (peft)
    r: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"


@dataclass
class PolicySchema:
    _target_: str = "rlhf_train.models.policy.build_policy"
    pretrained: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    dropout: Optional[float] = 0.0
    value_head_init_std: float = 0.0
    lora: LoraSchema = field(default_factory=LoraSchema)
    dtype: str = "float32"  # float32 | bfloat16


@dataclass
class RayServiceSchema:  # ref_model.ray_service -> rlhf_train.models.ray_reference (conf/ref_model/ documents it)
    enabled: bool = False
    actor_name: Optional[str] = None
    address: Optional[str] = None
    namespace: str = "rlhf_train"
    num_cpus: float = 1
    num_gpus: float = 0
    device: Optional[str] = None
    detached: bool = False


@dataclass
class RefModelSchema:
    _target_: str = "rlhf_train.models.policy.build_reference"
    pretrained: Optional[str] = None
    copy_policy: bool = True
    trust_remote_code: bool = False
    device: Optional[str] = None
    ray_service: RayServiceSchema = field(default_factory=RayServiceSchema)


@dataclass
class RewardModelSchema:
    _target_: str = "rlhf_train.models.reward_model.build_reward_model"
    pretrained: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = False
    device: Optional[str] = None
    weight: float = 1.0  # its weight in the sum of reward sources (the `rewards` entries are the others)


# ---------------------------------------------------------------- KL controllers
@dataclass
class ConstantKLSchema:
    _target_: str = "rlhf_train.rewards.kl_controllers.ConstantKLController"
    kl_coef: float = 0.05


@dataclass
class AdaptiveKLSchema:
    _target_: str = "rlhf_train.rewards.kl_controllers.AdaptiveKLController"
    init_kl_coef: float = 0.1
    target: float = 6.0
    horizon: int = 10000


# ---------------------------------------------------------------- data / rollout / PPO
# One schema per prompt dataset: the keys its function takes, plus `batch_size` and `num_workers`, which
# the training loop pops (DataLoader arguments) before instantiating the dataset. An unknown key fails at start.
@dataclass
class MovieReviewsDataSchema:  # conf/data/movie_reviews.yaml -> tasks.movie_reviews.prompts.movie_review_prompts
    _target_: str = "rlhf_train.tasks.movie_reviews.prompts.movie_review_prompts"
    batch_size: int = 128
    num_workers: int = 0
    split: str = "test"
    min_prompt_tokens: int = 8
    max_prompt_tokens: int = 16
    max_prompts: Optional[int] = None
    seed: int = 0
    prompt_baseline: bool = False
    sentiment: str = "all"


@dataclass
class SyntheticDataSchema:  # conf/data/synthetic.yaml -> rlhf_train.data.prompts.synthetic_prompts
    _target_: str = "rlhf_train.data.prompts.synthetic_prompts"
    batch_size: int = 4
    num_workers: int = 0
    min_prompt_tokens: int = 32
    max_prompt_tokens: int = 64
    max_prompts: Optional[int] = 1024
    seed: int = 0
    vocab_size: Optional[int] = None


@dataclass
class PromptsDataSchema:  # conf/data/prompts.yaml -> rlhf_train.data.hf_prompts.hf_prompts
    _target_: str = "rlhf_train.data.hf_prompts.hf_prompts"
    batch_size: int = 16
    num_workers: int = 0
    dataset: str = MISSING
    split: str = "train"
    prompt_column: Optional[str] = None
    text_as_chat: bool = False
    max_prompt_tokens: int = 256
    truncation: str = "drop"
    max_prompts: Optional[int] = None
    seed: int = 0
    shuffle: bool = False
    eval_holdout: int = 64
    system_prompt: Optional[str] = None
    few_shot: Optional[List[Dict[str, str]]] = None


@dataclass
class TldrDataSchema:  # conf/data/tldr.yaml -> rlhf_train.data.prompts.tldr_prompts
    _target_: str = "rlhf_train.data.prompts.tldr_prompts"
    batch_size: int = 4
    num_workers: int = 0
    dataset: str = "CarperAI/openai_summarize_tldr"
    split: str = "train"
    max_prompt_length: int = 500
    max_prompts: Optional[int] = None
    seed: int = 0


@dataclass
class RolloutSchema:
    max_new_tokens: int = 50
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    score_clip: Optional[float] = 10.0
    logprob_batch_size: Optional[int] = None
    num_samples: int = 1
    hf_generate: Optional[bool] = None  # removed: generation=hf_generate (the check names it)


@dataclass
class StaticCacheGenerationSchema:  # conf/generation/static_cache.yaml -> generation.static_cache.StaticCacheBackend
    _target_: str = "rlhf_train.generation.static_cache.StaticCacheBackend"
    compile: Optional[bool] = None  # None: on CUDA
    cache_multiple: int = 64
    check_every: int = 8


@dataclass
class OptimizerSchema:
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-5
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: Optional[bool] = None


@dataclass
class SchedulerSchema:
    name: str = "constant"
    warmup_steps: int = 0


@dataclass
class TrainerSchema:
    num_iterations: int = 100
    seed: int = 0
    checkpoint_every: int = 50
    samples_every: int = 10
    keep_checkpoints: int = 2
    resume: Optional[str] = None
    max_consecutive_faults: int = 3
    preempt_grace_s: Optional[float] = 25.0
    precision: Optional[str] = None      # fp32 | bf16 | fp16 (null: accelerate launch's, else fp32)
    fp32_lm_head: bool = True
    shared_prompt: bool = True
    mixed_precision: Optional[str] = None  # the older name of precision (no | bf16 | fp16), mapped to it
    cpu: bool = False
    num_threads: Optional[int] = None
    progress_bar: bool = True


@dataclass
class LoggerSchema:
    kind: str = MISSING
    project: str = "rlhf_train"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    mode: str = "auto"
    tags: List[str] = field(default_factory=list)


# ---------------------------------------------------------------- stages of the pipeline (rlhf_train/pipeline/run.py)
@dataclass
class SFTSchema:
    examples: Optional[str] = None  # the task's SFT data: dotted path of fn(cfg, tokenizer) -> (train, validation)
    dataset: Optional[str] = None
    train_split: str = "train"
    val_split: str = "valid"
    init: Optional[str] = None
    max_len: int = 64
    batch_size: int = 32
    max_steps: int = 600
    lr: float = 1e-3
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: Optional[float] = 1.0
    dropout: Optional[float] = 0.0
    eval_every: int = 200
    eval_batch_size: int = 64
    max_train_examples: Optional[int] = None
    max_eval_examples: Optional[int] = None
    seed: int = 0
    lora: LoraSchema = field(default_factory=LoraSchema)


@dataclass
class RMSchema:
    pairs: Optional[str] = None  # the task's preference pairs: dotted path of fn(cfg, tokenizer) -> (train, validation)
    dataset: Optional[str] = None
    train_split: str = "train"
    val_split: str = "valid1"
    backbone: str = "sft"
    freeze_backbone: bool = False
    encoder_max_length: int = 128
    max_len: int = 64
    batch_size: int = 32
    max_steps: int = 300
    lr: float = 3e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: Optional[float] = 1.0
    dropout: Optional[float] = 0.0
    eval_every: int = 100
    eval_batch_size: int = 64
    max_train_pairs: Optional[int] = None
    max_eval_pairs: Optional[int] = None
    normalize: bool = True
    seed: int = 0


@dataclass
class EvaluationSchema:
    enabled: bool = True
    split: str = "validation"
    num_prompts: int = 256
    batch_size: int = 64
    num_samples_shown: int = 4
    judge: bool = True
    judge_fn: Optional[str] = None  # the judge: dotted path of fn(cfg) -> a judge or None (null: no judge)
    task_check: Optional[str] = None  # pre-flight check of the task's options: dotted path of fn(cfg) -> None
    plot: bool = True
    seed: int = 0
    fluency_max_drop: float = 0.5
    # held-out evaluation of the reward sources (rlhf_train/loop/evaluation.py)
    num_samples: int = 1  # samples per prompt at the rollout's sampling settings (pass@k, mean@k)
    pass_k: List[int] = field(default_factory=list)  # the k of pass@k, each 1..num_samples; empty: num_samples
    greedy: bool = False  # also decode every prompt greedily (eval/greedy/...)
    accuracy_threshold: float = 1.0  # a reward function's row is correct when scored >= this
    every: int = 0  # the RL loop also evaluates every N iterations (stage=rl: at 0 and the last anyway)


@dataclass
class Config:
    stage: str = "rl"  # rl (the RL loop alone) | sft | rm | pipeline (rlhf_train/pipeline/stages.py)
    cache_dir: str = "${oc.env:RLHF_TRAIN_CACHE,${oc.env:HOME}/.cache/rlhf_train}"
    task_name: str = "rlhf"
    tokenizer: Any = MISSING
    policy: Any = MISSING
    ref_model: Any = MISSING
    reward_model: Optional[Any] = None  # reward_model=null: no reward model (the `rewards` entries score)
    # more reward sources by name (rlhf_train/rewards/sources.py); free-form entries (a function's keyword
    # arguments), their workers / timeout_s typed by rlhf_train/rewards/function_source.py's execution_settings
    rewards: Dict[str, Any] = field(default_factory=dict)
    kl_controller: Any = MISSING
    transforms: Any = MISSING
    data: Any = MISSING
    rollout: Any = MISSING
    generation: Any = MISSING  # the generation backend (conf/generation/: _target_ of a GenerationBackend)
    env: Any = MISSING  # the environment of multi-turn episodes (conf/env/; none: single-turn)
    update: Any = MISSING  # read it as cfg["update"] in Python: cfg.update is DictConfig's dict method
    algorithm: Any = MISSING
    ppo: Optional[Any] = None  # removed: its keys are update.* and algorithm.* (the check names each)
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    trainer: Any = MISSING
    logger: Any = MISSING
    # pipeline-only groups: null in conf/config.yaml; rlhf_train.pipeline.run names the one to set
    sft: Optional[Any] = None
    rm: Optional[Any] = None
    evaluation: Optional[Any] = None


def launch_time(pattern: str) -> str:
    """``${launch_time:%Y-%m-%d_%H-%M-%S}`` (``hydra.run.dir``): Hydra's ``${now:...}``, except that under
    ``accelerate launch`` / ``torchrun`` it is the launcher's start time, so all processes of one launch
    agree on the run dir (each process's own clock may be a second apart)."""
    import os
    from datetime import datetime

    if "LOCAL_RANK" in os.environ:
        try:
            import psutil

            return datetime.fromtimestamp(psutil.Process(os.getppid()).create_time()).strftime(pattern)
        except Exception:  # no psutil / no access: this process's clock
            pass
    return datetime.now().strftime(pattern)


def register_configs() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)
    from rlhf_train.infra.secrets import dirname_overrides

    OmegaConf.register_new_resolver("dirname_overrides", dirname_overrides, replace=True)
    from rlhf_train.pipeline.sweep import job_dirname

    OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)  # hydra.sweep.subdir
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="tokenizer", name="pretrained_schema", node=PretrainedTokenizerSchema)
    cs.store(group="tokenizer", name="movie_reviews_bpe_schema", node=MovieReviewsTokenizerSchema)
    cs.store(group="policy", name="policy_schema", node=PolicySchema)
    cs.store(group="ref_model", name="ref_model_schema", node=RefModelSchema)
    cs.store(group="reward_model", name="reward_model_schema", node=RewardModelSchema)
    cs.store(group="kl_controller", name="constant_schema", node=ConstantKLSchema)
    cs.store(group="kl_controller", name="adaptive_schema", node=AdaptiveKLSchema)
    cs.store(group="data", name="movie_reviews_schema", node=MovieReviewsDataSchema)
    cs.store(group="data", name="synthetic_schema", node=SyntheticDataSchema)
    cs.store(group="data", name="tldr_schema", node=TldrDataSchema)
    cs.store(group="data", name="prompts_schema", node=PromptsDataSchema)
    cs.store(group="data", name="arithmetic_schema", node=ArithmeticDataSchema)
    cs.store(group="data", name="gsm8k_schema", node=GSM8KDataSchema)
    cs.store(group="rollout", name="rollout_schema", node=RolloutSchema)
    cs.store(group="generation", name="static_cache_schema", node=StaticCacheGenerationSchema)
    register_env_schemas(cs)  # env, data=guess_number, data=calculator (rlhf_train/config/env_schemas.py)
    cs.store(group="update", name="update_schema", node=UpdateConfig)  # the typed section the update reads
    cs.store(group="algorithm", name="algorithm_schema", node=AlgorithmConfig)  # estimator, loss variant, KL place
    cs.store(group="optimizer", name="optimizer_schema", node=OptimizerSchema)
    cs.store(group="scheduler", name="scheduler_schema", node=SchedulerSchema)
    cs.store(group="trainer", name="trainer_schema", node=TrainerSchema)
    cs.store(group="logger", name="logger_schema", node=LoggerSchema)
    cs.store(group="sft", name="sft_schema", node=SFTSchema)
    cs.store(group="rm", name="rm_schema", node=RMSchema)
    cs.store(group="evaluation", name="evaluation_schema", node=EvaluationSchema)
