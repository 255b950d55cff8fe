"""The reward-source seam: complete sequences in, one score per sequence out.

The rollout scores each batch with a dict of weighted sources keyed by name (the reward model being
one of them): ``score = Σ_name weight · source(sequences)``, each source's raw score kept as
``reward_sources[name]`` (logged as ``reward/<name>``). Kinds of source:

* :class:`RewardModelSource`: a reward model (``RewardModel``, the re-encoding MiniLM model, an HF
  ``AutoModelForSequenceClassification``), ``(input_ids, attention_mask) -> (rewards, end_scores)``;
* :class:`FunctionRewardSource`: a Python function called once per batch as
  ``fn(prompts, completions, **columns) -> list[float | None]`` (TRL's ``reward_funcs`` signature;
  ``None``: no reward for that sample), or once per slice of the batch in each of its worker processes
  (:mod:`rlhf_train.rewards.executor`: ``rewards.<name>.workers``, ``rewards.<name>.timeout_s``, ``async
  def``). Functions are handed their batch first; the reward models and the reference pass
  (:func:`score_sources`' ``during``) run on the calling thread meanwhile (torch releases the GIL), so a
  slow function overlaps with the model passes. A call past its timeout, or whose worker died, scores
  ``None`` for its rows and is counted (:class:`RewardReport`).

``None`` / NaN rows: the weighted sum skips a function's None (NaN) for that row (``nansum``), so ``None`` never
skips an update. A row that no source scores sums to 0 but is not a reward of 0: the rollout marks it
(``Rollout.unscored``) and the critic-free estimators leave it out of its group's statistics with advantage 0,
TRL's rule since huggingface/trl#5902 (GRPO, RLOO). A reward model's NaN is a fault: the row's score is NaN
and the update skips that minibatch (``finite_rows`` in ``algorithms/base.py``).
:func:`build_reward_sources` builds the dict from the config (``reward_model`` + ``rewards``);
:func:`probe_reward_sources` scores one batch before training so that a broken source fails at start.
A new kind of source goes in ``rlhf_train/rewards/<name>.py`` as a callable with :meth:`RewardSource.__call__`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from tensordict import TensorDict

from rlhf_train.core.containers import right_pad
from rlhf_train.core.prompt_groups import prompt_groups
from rlhf_train.rewards.function_source import FunctionRewardSource, RewardFunctionError  # noqa: F401 (re-exported)


@dataclass
class Sequences:
    """What a reward source scores: ``B`` sequences of prompt + response in the policy's vocabulary.

    ``full [B, L]`` token ids, ``full_mask [B, L]`` (True on real tokens; any padding on either side).
    ``prompt_len``: ``full[:, :prompt_len]`` is the (left-padded) prompt, or ``None`` when the sequences
    are not split (e.g. a dataset's reference responses). ``columns``: other per-row data from the
    dataset (e.g. a reference answer), each a list of length ``B``.
    """

    full: torch.Tensor
    full_mask: torch.Tensor
    prompt_len: int | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)


class RewardSource(Protocol):
    """Scores sequences: ``(Sequences) -> [B]`` float tensor (NaN = no reward for that row)."""

    def __call__(self, sequences: Sequences) -> torch.Tensor: ...


class RewardModelSource:
    """A reward model with torchrl's ``GPT2RewardModel`` interface as a :class:`RewardSource`:
    ``model(input_ids, attention_mask) -> (rewards [B, L], end_scores [B])``; the score is ``end_scores``.

    Reward models receive **right-padded** sequences (real tokens first, positions from 0): that
    interface reads the end score at ``mask.sum(-1) - 1``, while the rollout's sequences are left-padded
    prompts followed by right-padded responses. Rows go through in chunks of ``batch_size`` (None = all).
    """

    def __init__(self, model: torch.nn.Module, pad_token_id: int = 0, batch_size: int | None = None):
        self.model, self.pad_token_id, self.batch_size = model, pad_token_id, batch_size

    @torch.no_grad()
    def __call__(self, sequences: Sequences) -> torch.Tensor:
        chat_aware = getattr(self.model, "score_sequences", None)  # e.g. an HF reward model with its chat template
        scores = chat_aware(sequences) if chat_aware is not None else None
        if scores is not None:
            return scores.float().to(sequences.full.device)
        shared = self.shared_prompt_scores(sequences)
        if shared is not None:
            return shared
        ids, mask = right_pad(sequences.full, sequences.full_mask, self.pad_token_id)
        width = int(mask.sum(-1).max()) if mask.numel() else 0
        ids, mask = ids[:, :max(width, 1)], mask[:, :max(width, 1)]  # drop all-padding columns
        device = next(self.model.parameters()).device
        step = self.batch_size or ids.shape[0] or 1
        out = []
        for a in range(0, ids.shape[0], step):
            _, end_scores = self.model(input_ids=ids[a:a + step].to(device), attention_mask=mask[a:a + step].to(device))
            out.append(end_scores.reshape(-1).float().to(sequences.full.device))
        return torch.cat(out) if out else torch.zeros(0, device=sequences.full.device)

    def shared_prompt_scores(self, sequences: Sequences) -> torch.Tensor | None:
        """The scores with each prompt that several rows share run through the model once (GRPO's samples of a
        prompt: the model's ``shared_prompt_scores``, :mod:`rlhf_train.models.shared_prompt`), in the rollout's
        own layout; ``None`` when no two rows share a prompt or the model has no such path (then every row is
        right-padded and scored whole)."""
        scores_of = getattr(self.model, "shared_prompt_scores", None)
        full, mask, P = sequences.full, sequences.full_mask, sequences.prompt_len
        if scores_of is None or P is None or prompt_groups(full, mask, P) is None:
            return None
        device = next(self.model.parameters()).device
        step = self.batch_size or full.shape[0]
        out = [scores_of(full[a:a + step].to(device), mask[a:a + step].to(device), P)
               for a in range(0, full.shape[0], step)]
        if any(o is None for o in out):
            return None
        return torch.cat(out).reshape(-1).float().to(full.device)


@dataclass
class RewardReport:
    """What scoring a batch cost, for the loop's metrics: ``seconds`` (``time/reward_s``: the reward models'
    passes or the longest function call, whichever is longer: the time scoring takes on its own, the
    reference pass beside it not included) and ``lost_rows`` per source (rows scored ``None`` because a
    call timed out or its worker died: ``faults/reward_timeouts``). Filled in by :func:`score_sources`."""

    seconds: float = 0.0
    lost_rows: dict[str, int] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return sum(self.lost_rows.values())


def weighted_sum(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences,
                 report: RewardReport | None = None) -> tuple[torch.Tensor, TensorDict]:
    """``(Σ_name weight · score_name [B], TensorDict of each source's raw score [B])``.

    Sources that run beside the others (``overlap = True``: Python functions) start first and are joined
    after them. A Python function's NaN (it returned None: no reward) is left out of that row's sum (a row
    no source rewards gets 0, as TRL's ``nansum``); a reward model's NaN makes the row's score NaN (a fault)."""
    total, parts, _ = score_sources(sources, sequences, report=report)
    return total, parts


def has_threaded(sources: dict[str, tuple[RewardSource, float]]) -> bool:
    return any(getattr(source, "overlap", False) for source, _ in sources.values())


def score_sources(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences,
                  during: Callable[[], Any] | None = None,
                  report: RewardReport | None = None) -> tuple[torch.Tensor, TensorDict, Any]:
    """:func:`weighted_sum`, plus ``during()`` (e.g. the reference pass) run on the calling thread while the
    overlapping sources (Python functions) score: ``(total, parts, during's result)``. ``report``: filled in
    (its seconds and lost rows added to), also when a function's raise is re-raised here."""
    from rlhf_train.rewards.executor import in_thread

    B, device = sequences.full.shape[0], sequences.full.device
    t0 = time.perf_counter()
    pending = {name: source.start(sequences) if isinstance(source, FunctionRewardSource)
               else in_thread(lambda source=source: source(sequences))
               for name, (source, _) in sources.items() if getattr(source, "overlap", False)}
    scores, first_error, longest = {}, None, 0.0
    try:
        scores.update({name: source(sequences) for name, (source, _) in sources.items() if name not in pending})
        models_s = time.perf_counter() - t0
        extra = during() if during is not None else None
    finally:  # every call handed over is collected (or its workers stopped), whatever failed above
        for name, handle in pending.items():
            source = sources[name][0]
            try:
                if isinstance(source, FunctionRewardSource):
                    scores[name], lost, seconds = source.finish(handle)
                    if report is not None and lost:
                        report.lost_rows[name] = report.lost_rows.get(name, 0) + lost
                else:
                    result = handle.result()
                    if result.raised is not None:
                        raise result.error
                    scores[name], seconds = result.out, result.seconds
                longest = max(longest, seconds)
            except BaseException as err:  # noqa: BLE001  (the first one is raised once all are collected)
                first_error = first_error or err
    if report is not None:
        report.seconds += max(models_s, longest)
    if first_error is not None:
        raise first_error
    parts = TensorDict({name: scores[name] for name in sources}, batch_size=[B], device=device)
    total = torch.zeros(B, device=device)
    fault = torch.zeros(B, dtype=torch.bool, device=device)
    for name, (source, weight) in sources.items():
        x = parts[name].float()
        if getattr(source, "overlap", False):
            # a Python function's NaN is its None, "no reward for this sample": left out of the row's sum, as
            # TRL's nansum does (a row that no source rewards sums to 0: Rollout.unscored), never a fault
            x = x.nan_to_num(nan=0.0, posinf=torch.inf, neginf=-torch.inf)
        else:  # a reward model's NaN is a fault: the row's score is NaN (the update skips and counts it)
            fault |= torch.isnan(x)
        total = total + float(weight) * x
    return total.masked_fill(fault, float("nan")), parts, extra


def reward_weight(value: Any, key: str) -> float:
    """A source's weight as a finite float, or one line naming the key."""
    from rlhf_train.infra.errors import ConfigError

    try:
        weight = float(value)
    except (TypeError, ValueError):
        weight = float("nan")
    if not math.isfinite(weight) or isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is not a finite number: set it to a float such as 1.0 (0 turns the "
                          f"source off in the sum; it is still logged)")
    return weight


def build_reward_sources(reward_model: torch.nn.Module | None, entries: dict | None, tokenizer: Any,
                         pad_token_id: int, batch_size: int | None = None, reward_model_weight: float = 1.0,
                         device: Any = "cpu") -> dict[str, tuple[RewardSource, float]]:
    """``{name: (source, weight)}``: ``reward_model`` (when not None) as ``"reward_model"``, then each entry
    of the ``rewards`` config: ``{_target_, weight (default 1), ...keyword arguments}``.

    ``_target_`` is imported. A function whose parameters include ``prompts`` and ``completions`` is a reward
    function (the other keys bound as keyword arguments); anything else is a factory, called with the other
    keys (and ``tokenizer=`` when it takes one): it returns a reward model (an ``nn.Module`` with the
    ``(input_ids, attention_mask) -> (rewards, end_scores)`` interface) or a reward function.
    """
    import functools
    import inspect

    from hydra.utils import instantiate

    from rlhf_train.infra.errors import ConfigError

    from rlhf_train.rewards.executor import EXECUTION_KEYS
    from rlhf_train.rewards.function_source import check_picklable, execution_settings

    sources: dict[str, tuple[RewardSource, float]] = {}
    if reward_model is not None:
        weight = reward_weight(reward_model_weight, "reward_model.weight")
        sources["reward_model"] = (RewardModelSource(reward_model, pad_token_id, batch_size), weight)
    for name, entry in (entries or {}).items():
        key = f"rewards.{name}"
        entry = dict(entry or {})
        if name in sources:
            raise ConfigError(f"{key}: the name '{name}' is taken by the reward_model group; choose another name")
        target = entry.pop("_target_", None)
        weight = reward_weight(entry.pop("weight", 1.0), f"{key}.weight")
        workers, timeout_s = execution_settings(entry, key)
        execution = {k: entry.pop(k) for k in EXECUTION_KEYS if k in entry}
        if not target:
            raise ConfigError(f"{key}._target_ is not set: set it to a reward function (my_module.my_reward) or a "
                              f"reward-model factory (rlhf_train.models.reward_model.build_reward_model)")
        try:  # through Hydra's instantiate (as a partial, nothing called): its target policy applies here too
            obj = instantiate({"_target_": str(target), "_partial_": True}).func
        except Exception as err:
            first = " ".join(str(err).split())
            why = (f"is refused by Hydra's target policy ({first[:160]})" if "blocklisted" in first
                   else f"cannot be imported ({first[:160]}); is its module on PYTHONPATH?")
            raise ConfigError(f"{key}._target_={target} {why}") from None
        try:
            params = inspect.signature(obj).parameters if callable(obj) else {}
        except (TypeError, ValueError):
            params = {}
        if not callable(obj):
            raise ConfigError(f"{key}._target_={target} is not callable")
        if "prompts" in params and "completions" in params and not inspect.isclass(obj):
            fn = functools.partial(obj, **{k: _plain(v) for k, v in entry.items()})
            if workers:
                check_picklable(fn, key)
            sources[name] = (FunctionRewardSource(fn, tokenizer, name, workers, timeout_s), weight)
            continue
        if "tokenizer" in params:
            entry["tokenizer"] = tokenizer
        if "override" in params:
            entry["override"] = f"{key}.pretrained"
        built = obj(**entry)
        if isinstance(built, torch.nn.Module):
            if execution:
                raise ConfigError(f"{key}.{next(iter(execution))}: only reward functions run in worker processes "
                                  f"with a timeout; a reward model scores in the trainer's process (drop the key)")
            built.eval().requires_grad_(False).to(device)
            sources[name] = (RewardModelSource(built, pad_token_id, batch_size), weight)
        elif callable(built):
            if workers:
                check_picklable(built, key)
            sources[name] = (FunctionRewardSource(built, tokenizer, name, workers, timeout_s), weight)
        else:
            raise ConfigError(f"{key}._target_={target} returned {type(built).__name__}, neither a reward model "
                              f"nor a reward function")
    if not sources:
        raise ConfigError("no reward source: select a reward_model (e.g. reward_model=pretrained "
                          "reward_model.pretrained=DIR) or add one under rewards.<name>")
    return sources


def _plain(value: Any) -> Any:
    """A config value as plain Python (an OmegaConf list / dict node as a list / dict): what a function gets."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def close_sources(sources: dict[str, tuple[RewardSource, float]]) -> None:
    """Stop the worker processes of every source that has them (the end of a run)."""
    for source, _ in sources.values():
        close = getattr(source, "close", None)
        if close is not None:
            close()


def probe_reward_sources(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences) -> None:
    """Score one batch with every source before training: a source that raises, returns the wrong shape or
    NaN / inf (a function's ``None`` is fine) stops the run with one line naming it."""
    from rlhf_train.infra.errors import ConfigError

    try:
        _probe(sources, sequences)
    except ConfigError:
        close_sources(sources)  # the run stops here: no worker process is left behind
        raise


def _probe(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences) -> None:
    from rlhf_train.infra.errors import ConfigError

    B = sequences.full.shape[0]
    empty = sequences.prompt_len is not None and sequences.prompt_len >= sequences.full.shape[1]
    on = "on the first batch" + (" (its prompts, with empty completions)" if empty else "")
    for name, (source, _) in sources.items():
        what = f"reward function '{name}'" if isinstance(source, FunctionRewardSource) else f"reward source '{name}'"
        try:
            if isinstance(source, FunctionRewardSource):  # a timeout or a dead worker here stops the run too
                scores, lost, _ = source.finish(source.start(sequences), warn=False)
                if lost:
                    why = source.last_lost[0]
                    raise ConfigError(f"{on}, {what} {why}; fix the function"
                                      + (f" or raise rewards.{name}.timeout_s" if "timeout_s" in why else ""))
            else:
                scores = source(sequences)
        except ConfigError:
            raise
        except RewardFunctionError as err:
            raise ConfigError(f"{on}, {err}") from None
        except Exception as err:
            raise ConfigError(f"{on}, {what} failed ({type(err).__name__}: {err}); "
                              f"check reward_model / rewards.{name}") from None
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (B,):
            raise ConfigError(f"{on}, {what} returned shape {tuple(getattr(scores, 'shape', ()))}, expected [{B}]")
        if not bool(torch.isfinite(scores.float()).all()) and not isinstance(source, FunctionRewardSource):
            raise ConfigError(f"{on}, {what} returned NaN or inf; check reward_model / rewards.{name}")
