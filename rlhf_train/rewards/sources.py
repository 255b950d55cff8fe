"""The reward-source seam: complete sequences in, one score per sequence out.

The rollout scores each batch with a dict of weighted sources keyed by name (the reward model being
one of them): ``score = Σ_name weight · source(sequences)``, each source's raw score kept as
``reward_sources[name]`` (logged as ``reward/<name>``). Kinds of source:

* :class:`RewardModelSource`: a reward model (``RewardModel``, the re-encoding MiniLM model, an HF
  ``AutoModelForSequenceClassification``), ``(input_ids, attention_mask) -> (rewards, end_scores)``;
* :class:`FunctionRewardSource`: a Python function called once per batch as
  ``fn(prompts, completions, **columns) -> list[float | None]`` (TRL's ``reward_funcs`` signature;
  ``None``: no reward for that sample). Functions run in a worker thread while the reward models and the
  reference pass (:func:`score_sources`' ``during``) run on the calling thread (torch releases the GIL), so
  a slow function overlaps with the model passes.

``None`` / NaN rows: as in TRL, the weighted sum skips a function's None (NaN) for that row (``nansum``: a row
that no source rewards gets 0), so ``None`` never skips an update; a reward model's NaN is a fault: the row's
score is NaN and the update skips that minibatch (``finite_rows`` in ``algorithms/base.py``).
:func:`build_reward_sources` builds the dict from the config (``reward_model`` + ``rewards``);
:func:`probe_reward_sources` scores one batch before training so that a broken source fails at start.
A new kind of source goes in ``rlhf_train/rewards/<name>.py`` as a callable with :meth:`RewardSource.__call__`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from tensordict import TensorDict

from rlhf_train.core.containers import right_pad


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


def weighted_sum(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences) -> tuple[torch.Tensor, TensorDict]:
    """``(Σ_name weight · score_name [B], TensorDict of each source's raw score [B])``.

    Sources that run in a thread (``overlap = True``: Python functions) start first and are joined after
    the others. A Python function's NaN (it returned None: no reward) is left out of that row's sum (a row
    no source rewards gets 0, as TRL's ``nansum``); a reward model's NaN makes the row's score NaN (a fault)."""
    total, parts, _ = score_sources(sources, sequences)
    return total, parts


def has_threaded(sources: dict[str, tuple[RewardSource, float]]) -> bool:
    return any(getattr(source, "overlap", False) for source, _ in sources.values())


def score_sources(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences,
                  during: Callable[[], Any] | None = None) -> tuple[torch.Tensor, TensorDict, Any]:
    """:func:`weighted_sum`, plus ``during()`` (e.g. the reference pass) run on the calling thread while the
    threaded sources (Python functions) score: ``(total, parts, during's result)``."""
    B, device = sequences.full.shape[0], sequences.full.device
    futures = {name: _pool().submit(source, sequences) for name, (source, _) in sources.items()
               if getattr(source, "overlap", False)}
    scores = {name: source(sequences) for name, (source, _) in sources.items() if name not in futures}
    extra = during() if during is not None else None
    scores.update({name: f.result() for name, f in futures.items()})
    parts = TensorDict({name: scores[name] for name in sources}, batch_size=[B], device=device)
    total = torch.zeros(B, device=device)
    fault = torch.zeros(B, dtype=torch.bool, device=device)
    for name, (source, weight) in sources.items():
        x = parts[name].float()
        if getattr(source, "overlap", False):
            # a Python function's NaN is its None, "no reward for this sample": left out of the row's sum, as
            # TRL's nansum does (a row that no source rewards gets 0), never a fault that skips the update
            x = x.nan_to_num(nan=0.0, posinf=torch.inf, neginf=-torch.inf)
        else:  # a reward model's NaN is a fault: the row's score is NaN (the update skips and counts it)
            fault |= torch.isnan(x)
        total = total + float(weight) * x
    return total.masked_fill(fault, float("nan")), parts, extra


_POOL = None


def _pool():
    """One worker thread for the reward functions (created on first use)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-fn")
    return _POOL


class RewardFunctionError(RuntimeError):
    """A reward function raised or returned something unusable; the message names the source."""


class FunctionRewardSource:
    """A Python reward function as a :class:`RewardSource`, called once per batch (TRL's signature):

    ``fn(prompts=[B] str, completions=[B] str, **columns) -> list[float | None]`` of length ``B``.
    ``prompts``: each prompt as the policy saw it (chat template applied; padding dropped);
    ``completions``: the response text (special tokens such as EOS dropped); ``columns``: the dataset's
    other columns for each row (e.g. ``answer``). ``None`` -> NaN (no reward for that row). A raise (any
    ``BaseException``, ``sys.exit`` included), a wrong length, a non-number or a number that is NaN / inf
    in float32 raises :class:`RewardFunctionError` naming the source (the loop skips the batch and counts it).
    """

    overlap = True  # runs in the reward worker thread, beside the reward models

    def __init__(self, fn: Callable, tokenizer: Any, name: str = "function"):
        self.fn, self.tokenizer, self.name = fn, tokenizer, name

    def texts(self, sequences: Sequences) -> tuple[list[str], list[str]]:
        P = sequences.prompt_len if sequences.prompt_len is not None else 0
        full, mask = sequences.full.cpu(), sequences.full_mask.cpu().bool()
        prompts = [row[m].tolist() for row, m in zip(full[:, :P], mask[:, :P])]
        completions = [row[m].tolist() for row, m in zip(full[:, P:], mask[:, P:])]
        dec = self.tokenizer.batch_decode
        return dec(prompts, skip_special_tokens=False), dec(completions, skip_special_tokens=True)

    def __call__(self, sequences: Sequences) -> torch.Tensor:
        prompts, completions = self.texts(sequences)
        B = len(completions)
        try:
            out = self.fn(prompts=prompts, completions=completions, **sequences.columns)
        except Exception as err:
            raise RewardFunctionError(f"reward function '{self.name}' raised {type(err).__name__}: {err}") from err
        except BaseException as err:  # sys.exit(), KeyboardInterrupt raised by the function itself, ...: a fault
            raise RewardFunctionError(f"reward function '{self.name}' raised {type(err).__name__}"
                                      f"{f'({err})' if str(err) else ''} (it must return, not exit)") from None
        return self.check(out, B, sequences.full.device)

    def check(self, out: Any, B: int, device) -> torch.Tensor:
        """``out`` as a ``[B]`` float32 tensor (None -> NaN), or :class:`RewardFunctionError`: not a sequence
        of numbers (a ``str`` is not a list of rewards), the wrong length, or a number that is NaN / inf in
        float32 (e.g. 1e39) — a fault of this function, counted like a raise."""
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
            raise RewardFunctionError(f"reward function '{self.name}' must return a list of float | None, "
                                      f"got {type(out).__name__}: {str(out)[:80]}")
        try:
            values = [float("nan") if v is None else float(v) for v in out]
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function '{self.name}' must return a list of float | None, "
                                      f"got {type(out).__name__}: {str(out)[:80]}") from None
        if len(values) != B:
            raise RewardFunctionError(f"reward function '{self.name}' returned {len(values)} values for a batch of {B}")
        scores = torch.tensor(values, dtype=torch.float32, device=device)
        given = torch.tensor([v is not None for v in out], dtype=torch.bool, device=device)
        bad = given & ~torch.isfinite(scores)  # NaN / inf returned (not None), or past float32's range
        if bad.any():
            i = int(bad.nonzero()[0])
            raise RewardFunctionError(f"reward function '{self.name}' returned {list(out)[i]!r} for row {i}: "
                                      f"NaN or inf in float32 (return None for 'no reward')")
        return scores


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
            sources[name] = (FunctionRewardSource(functools.partial(obj, **entry), tokenizer, name), weight)
            continue
        if "tokenizer" in params:
            entry["tokenizer"] = tokenizer
        if "override" in params:
            entry["override"] = f"{key}.pretrained"
        built = obj(**entry)
        if isinstance(built, torch.nn.Module):
            built.eval().requires_grad_(False).to(device)
            sources[name] = (RewardModelSource(built, pad_token_id, batch_size), weight)
        elif callable(built):
            sources[name] = (FunctionRewardSource(built, tokenizer, name), weight)
        else:
            raise ConfigError(f"{key}._target_={target} returned {type(built).__name__}, neither a reward model "
                              f"nor a reward function")
    if not sources:
        raise ConfigError("no reward source: select a reward_model (e.g. reward_model=pretrained "
                          "reward_model.pretrained=DIR) or add one under rewards.<name>")
    return sources


def probe_reward_sources(sources: dict[str, tuple[RewardSource, float]], sequences: Sequences) -> None:
    """Score one batch with every source before training: a source that raises, returns the wrong shape or
    NaN / inf (a function's ``None`` is fine) stops the run with one line naming it."""
    from rlhf_train.infra.errors import ConfigError

    B = sequences.full.shape[0]
    empty = sequences.prompt_len is not None and sequences.prompt_len >= sequences.full.shape[1]
    on = "on the first batch" + (" (its prompts, with empty completions)" if empty else "")
    for name, (source, _) in sources.items():
        what = f"reward function '{name}'" if isinstance(source, FunctionRewardSource) else f"reward source '{name}'"
        try:
            scores = source(sequences)
        except RewardFunctionError as err:
            raise ConfigError(f"{on}, {err}") from None
        except Exception as err:
            raise ConfigError(f"{on}, {what} failed ({type(err).__name__}: {err}); "
                              f"check reward_model / rewards.{name}") from None
        if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (B,):
            raise ConfigError(f"{on}, {what} returned shape {tuple(getattr(scores, 'shape', ()))}, expected [{B}]")
        if not bool(torch.isfinite(scores.float()).all()) and not isinstance(source, FunctionRewardSource):
            raise ConfigError(f"{on}, {what} returned NaN or inf; check reward_model / rewards.{name}")
