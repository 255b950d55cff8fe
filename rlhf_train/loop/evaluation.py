"""Held-out evaluation of the reward sources: what the pipeline's evaluation stage and the RL loop measure on
prompts held out of training (``evaluation`` config group; the keys in docs/metrics.md, ``eval/...``).

On the first ``evaluation.num_prompts`` prompts of ``evaluation.split`` (:func:`eval_prompts`; a dataset without
splits: the rows ``data.eval_holdout`` keeps out of training) the policy is decoded two ways through the
``generation`` group's backend:

* ``sampled``: ``evaluation.num_samples`` samples per prompt at the rollout's sampling settings (temperature,
  top-k, top-p), torch's generator seeded with ``evaluation.seed``;
* ``greedy`` (``evaluation.greedy``): one greedy decode per prompt (``do_sample`` false).

Every reward source of the run scores every completion (the rollout's own call, prompts' other columns
included), and :func:`held_out_metrics` reports per source ``eval/<mode>/<name>/mean``; for reward functions
(a verifier, ``final_answer_match``: not reward models, whose scores have no "correct") also ``accuracy`` (the
share of completions scored ≥ ``evaluation.accuracy_threshold``) and, sampled, ``pass@k`` (Chen et al.'s
unbiased estimator, each k of ``evaluation.pass_k``) and ``mean@n``; and ``eval/<mode>/completion_length`` (mean
tokens). The math is :mod:`rlhf_train.core.eval_metrics`.

With an environment (``env``), each held-out prompt starts ``evaluation.num_samples`` episodes (greedy: one),
played to their ends as in training (:class:`~rlhf_train.rollout.episodes.EpisodePlayer`, token in, token out) with
the same backends; the environment's summed reward is the source ``env`` (``eval/<mode>/env/accuracy``: the share
of episodes whose reward reached ``evaluation.accuracy_threshold``, the success rate), every other source scores
the whole episode, ``completion_length`` counts the tokens the policy sampled, and the episodes' ``env/...``
metrics come as ``eval/<mode>/env/turns`` and so on.

The RL loop evaluates with :class:`HeldOutEval` when ``evaluation`` is set and enabled (``stage=rl``; the
pipeline's RL stage only with ``evaluation.every`` > 0): before the first iteration (a fresh run), every
``evaluation.every`` iterations and after the last. It draws its randomness inside a forked RNG (torch's CPU and
CUDA generators, Python's and NumPy's restored afterwards), so the training's stream, its metrics and an exact
resume are the same with and without it. Every process evaluates all held-out prompts (FSDP / ZeRO-3 gather the
weights collectively); the main process logs.
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
import torch
from omegaconf import DictConfig, OmegaConf

from rlhf_train.core.containers import response_mask_from_tokens
from rlhf_train.core.eval_metrics import accuracy, is_correct, mean_at_k, nan_mean, pass_at_k
from rlhf_train.infra.errors import instantiate_or_config_error
from rlhf_train.envs.base import EpisodeRewards
from rlhf_train.rewards.sources import RewardFunctionError, Sequences, weighted_sum
from rlhf_train.rollout.episodes import EpisodePlayer, episode_metrics, episode_tensors
from rlhf_train.rollout.rollout_from_model import prompt_tensors, special_ids

log = logging.getLogger(__name__)

MODES = ("sampled", "greedy")


def eval_prompts(cfg: DictConfig, tokenizer):
    """The held-out prompts: the ``data`` config with ``max_prompts = evaluation.num_prompts`` and, for a dataset
    with splits, ``split = evaluation.split``."""
    data = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in ("batch_size", "num_workers")}
    data["max_prompts"] = cfg.evaluation.num_prompts
    if "split" in data:  # a dataset with splits (synthetic prompts have none)
        data["split"] = cfg.evaluation.split
    return instantiate_or_config_error(data, tokenizer=tokenizer)


def function_sources(sources: dict) -> set[str]:
    """The names of the sources that have a "correct": every one but the reward models (as the training's
    ``reward/<name>/accuracy``)."""
    from rlhf_train.loop.metrics import accuracy_thresholds

    return set(accuracy_thresholds(sources))


def repeat_columns(batch: dict, rows: int) -> dict[str, list]:
    """The batch's other columns (``{name: [N] values}``), each value repeated for its prompt's samples."""
    cols = batch.get("columns") or {}
    if not cols:
        return {}
    k = rows // max(len(next(iter(cols.values()))), 1)
    return {name: [v for v in values for _ in range(k)] for name, values in cols.items()}


@torch.no_grad()
def generate_and_score(backend, sources: dict, batch: dict, num_samples: int, eos_token_ids, pad_token_id: int) -> dict:
    """Decode ``batch``'s prompts ``num_samples`` times each and score every completion with every source:
    ``{"parts": {name: [B] scores}, "length": [B] response tokens}``, ``B = prompts × num_samples``, the samples
    of a prompt adjacent. (Not :class:`~rlhf_train.rollout.rollout_from_model.RolloutFromModel`: an evaluation
    needs no log-probs, reference pass or shaping, and a greedy backend gives no log-probs, so the rollout would
    add a policy pass.)"""
    prompt, prompt_mask = prompt_tensors(batch, pad_token_id)
    gen = backend.generate(prompt, prompt_mask, num_samples)
    if num_samples > 1:
        prompt, prompt_mask = prompt.repeat_interleave(num_samples, 0), prompt_mask.repeat_interleave(num_samples, 0)
    response_mask = response_mask_from_tokens(gen.response, eos_token_ids)
    full = torch.cat([prompt, gen.response.to(prompt.device)], 1)
    full_mask = torch.cat([prompt_mask.bool(), response_mask.to(prompt.device)], 1)
    _, parts = weighted_sum(sources, Sequences(full, full_mask, prompt.shape[1], repeat_columns(batch, full.shape[0])))
    return {"parts": {name: parts[name].float().cpu() for name in sources}, "length": response_mask.sum(-1).cpu()}


@torch.no_grad()
def play_and_score(player: EpisodePlayer, backend, sources: dict, batch: dict, num_samples: int) -> dict:
    """:func:`generate_and_score` for an environment: ``num_samples`` episodes per prompt of ``batch`` played with
    ``backend``, the episodes' rewards loaded into the ``env`` source, every source scoring the whole episodes:
    ``{"parts", "length"}`` as there (the length: the tokens the policy sampled) and ``"episodes"``."""
    episodes, _ = player.play_batch(backend, batch, num_samples)
    t = episode_tensors(episodes, player.pad_token_id, batch["input_ids"].device)
    for source, _ in sources.values():
        if isinstance(source, EpisodeRewards):
            source.load(t["reward"])
    full_mask = torch.cat([t["prompt_mask"], t["response_mask"]], 1)
    seqs = Sequences(t["full"], full_mask, t["prompt_mask"].shape[1], repeat_columns(batch, len(episodes)))
    _, parts = weighted_sum(sources, seqs)
    return {"parts": {name: parts[name].float().cpu() for name in sources},
            "length": t["assistant_mask"].sum(-1).cpu(), "episodes": episodes}


def held_out_metrics(mode: str, parts: dict[str, torch.Tensor], lengths: torch.Tensor, num_samples: int,
                     functions: set[str], threshold: float = 1.0, pass_k: list[int] | None = None) -> dict[str, float]:
    """The ``eval/<mode>/...`` metrics of one decoding mode from each source's scores ``[P · n]`` (the ``n =
    num_samples`` samples of a prompt adjacent; NaN: not scored) and the completions' lengths ``[P · n]``."""
    out = {f"eval/{mode}/completion_length": lengths.double().mean()}
    for name, scores in parts.items():
        key = f"eval/{mode}/{name}"
        out[f"{key}/mean"] = nan_mean(scores)
        if name not in functions:
            continue
        out[f"{key}/accuracy"] = accuracy(scores, threshold)
        if mode == "sampled":
            grid = scores.view(-1, num_samples)  # [P, n]
            for k in pass_k or [num_samples]:
                out[f"{key}/pass@{k}"] = pass_at_k(is_correct(grid, threshold), k).mean()
            out[f"{key}/mean@{num_samples}"] = mean_at_k(grid)
    return {k: float(v) for k, v in out.items()}


def episode_eval_metrics(mode: str, episodes) -> dict[str, float]:
    """The held-out episodes' ``env/...`` metrics (:func:`~rlhf_train.rollout.episodes.episode_metrics`) of one
    decoding mode: ``eval/<mode>/env/turns`` and so on."""
    return {f"eval/{mode}/{k}": v for k, v in episode_metrics(episodes).items()}


def evaluate_held_out(backends: dict, sources: dict, prompts, e: DictConfig, eos_token_ids,
                      pad_token_id: int, player: EpisodePlayer | None = None) -> tuple[dict[str, float], dict[str, dict]]:
    """Decode ``prompts`` with each backend of ``backends`` (``{"sampled" | "greedy": backend}``) and score:
    ``(metrics, {mode: {"parts": ..., "length": ...}})``, every row kept. ``player``: play episodes of its
    environment instead (module docstring)."""
    from torch.utils.data import DataLoader

    from rlhf_train.data.prompts import collate

    loader = DataLoader(prompts, batch_size=e.batch_size, shuffle=False, collate_fn=getattr(prompts, "collate", collate))
    functions, metrics, rows = function_sources(sources), {}, {}
    for mode, backend in backends.items():
        n = e.num_samples if mode == "sampled" else 1
        if mode == "sampled":
            torch.manual_seed(e.seed)  # the same samples for every policy evaluated
        outs = [generate_and_score(backend, sources, batch, n, eos_token_ids, pad_token_id) if player is None
                else play_and_score(player, backend, sources, batch, n) for batch in loader]
        parts = {name: torch.cat([o["parts"][name] for o in outs]) for name in sources}
        rows[mode] = {"parts": parts, "length": torch.cat([o["length"] for o in outs])}
        metrics.update(held_out_metrics(mode, parts, rows[mode]["length"], n, functions, e.accuracy_threshold,
                                        list(e.pass_k)))
        if player is not None:
            metrics.update(episode_eval_metrics(mode, [ep for o in outs for ep in o["episodes"]]))
    return metrics, rows


def build_backends(cfg: DictConfig, policy, eos_token_ids, pad_token_id: int, sampling, unwrap_fn,
                   modes: tuple[str, ...] = MODES) -> dict:
    """``{"sampled": ..., "greedy": ...}`` of ``modes`` (greedy only with ``evaluation.greedy``): the ``generation``
    group's backend, without log-probs or values; greedy with ``rollout.do_sample`` false."""
    from rlhf_train.loop.components import build_backend

    backends = {}
    for mode in modes:
        if mode == "greedy" and not cfg.evaluation.greedy:
            continue
        mode_cfg = cfg if mode == "sampled" else OmegaConf.merge(cfg, {"rollout": {"do_sample": False}})
        backends[mode] = build_backend(mode_cfg, policy, eos_token_ids, pad_token_id, sampling, False, unwrap_fn)
    return backends


@contextlib.contextmanager
def isolated_rng():
    """Run the block on a fork of every RNG it could draw from (torch's CPU and CUDA generators, Python's,
    NumPy's): afterwards each is where it was, whatever the block drew."""
    import numpy as np

    py, np_state = random.getstate(), np.random.get_state()
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)


def summary_line(metrics: dict[str, float]) -> str:
    """The metrics in one line: accuracies, pass@k, completion lengths and episodes' turns (every metric when none
    of these)."""
    keys = [k for k in metrics if k.endswith(("/accuracy", "/completion_length", "/env/turns")) or "/pass@" in k]
    keys = keys or list(metrics)
    return ", ".join(f"{k[len('eval/'):]} {metrics[k]:.3f}" for k in keys)


class HeldOutEval:
    """The RL loop's held-out evaluation (module docstring): ``due(iteration)`` says when, ``run_at(iteration)``
    evaluates the current policy and returns the ``eval/...`` metrics (and ``time/eval_s``)."""

    def __init__(self, run, prompts):
        cfg, acc = run.cfg, run.accelerator
        self.run, self.prompts, self.e = run, prompts, cfg.evaluation
        self.every, self.last = int(self.e.every), int(cfg.trainer.num_iterations)
        self.eos, self.pad = special_ids(acc.unwrap_model(run.policy).lm, run.tokenizer)
        self.backends = build_backends(cfg, run.policy, self.eos, self.pad, run.decisions.sampling, acc.unwrap_model)
        env = getattr(run.rollout, "env", None)  # an environment's episodes (MultiTurnRollout), else completions
        self.player = EpisodePlayer(env, run.tokenizer, self.eos, self.pad) if env is not None else None

    @classmethod
    def build(cls, run) -> HeldOutEval | None:
        """``None`` unless ``evaluation`` is set and enabled."""
        e = run.cfg.get("evaluation")
        if e is None or not e.enabled:
            return None
        with isolated_rng():  # (building draws nothing the training would)
            prompts = eval_prompts(run.cfg, run.tokenizer)
            held_out = cls(run, prompts)
        if run.accelerator.is_main_process:
            log.info("[rlhf_train] held-out evaluation on %d prompts of split '%s' (%d sampled per prompt%s): "
                     "at iteration 0, %safter the last", len(prompts), e.split, e.num_samples,
                     ", and greedy" if e.greedy else "", f"every {e.every} iterations, " if e.every else "")
        return held_out

    def due(self, iteration: int) -> bool:
        return iteration == self.last or (self.every > 0 and iteration % self.every == 0)

    def run_at(self, iteration: int) -> dict[str, float]:
        from rlhf_train.infra.distributed import full_weights

        t0 = time.perf_counter()
        policy, acc = self.run.policy, self.run.accelerator
        was_training = policy.training
        policy.eval()
        try:
            with full_weights(policy, acc), isolated_rng():
                metrics, _ = evaluate_held_out(self.backends, self.run.rollout.reward_sources, self.prompts, self.e,
                                               self.eos, self.pad, self.player)
        except RewardFunctionError as err:  # the evaluation is lost, the training goes on
            log.warning("[rlhf_train] held-out evaluation at iteration %d skipped: %s", iteration, err)
            metrics = {}
        finally:
            policy.train(was_training)
        if metrics and acc.is_main_process:
            log.info("[rlhf_train] held-out evaluation at iteration %d: %s", iteration, summary_line(metrics))
        return {**metrics, "time/eval_s": time.perf_counter() - t0}

