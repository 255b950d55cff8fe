"""What the pipeline (:mod:`rlhf_train.pipeline`) needs from the movie-review task, named by the task's YAML.

The pipeline never imports this task: the config names each function by its dotted path, and the
pipeline resolves it (``hydra.utils.get_method``) and calls it with the composed config:

* ``sft.examples`` (``conf/sft/sentiment.yaml``) -> :func:`sft_examples`: the SFT token tensors;
* ``rm.pairs`` (``conf/rm/sentiment.yaml``) -> :func:`preference_pairs`: the reward model's pairs;
* ``evaluation.judge_fn`` (``conf/evaluation/default.yaml``) -> :func:`judge`: the independent judge;
* ``evaluation.task_check`` (``conf/evaluation/default.yaml``) -> :func:`check_options`: the task's
  ``data.*`` options, checked in the pipeline's pre-flight, before any stage runs.

Every split comes from the seeded split of :mod:`rlhf_train.tasks.movie_reviews.data` (``data.seed``),
so the SFT, reward-model, judge and prompt splits stay disjoint.
"""
from __future__ import annotations

import logging

from omegaconf import DictConfig

log = logging.getLogger(__name__)


def reads_movie_reviews(cfg: DictConfig) -> bool:
    """Whether ``cfg.data`` is this task's prompts (``conf/data/movie_reviews.yaml``)."""
    return str(cfg.data.get("_target_", "")).endswith("movie_review_prompts")


def movie_review_splits(seed: int) -> dict:
    """The seeded, disjoint splits of the reviews: ``sft_train``, ``rm_train``, ``judge_train``, ``validation``, ``test``."""
    from rlhf_train.tasks.movie_reviews.data import load_reviews, split_reviews

    return split_reviews(load_reviews("imdb"), seed=seed)


def sft_examples(cfg: DictConfig, tokenizer) -> tuple[dict, dict]:
    """(train, validation) ``{"input_ids", "attention_mask"}`` ``[N, sft.max_len]``: the ``sft_train`` and
    ``validation`` reviews (at most ``sft.max_train_examples`` / ``sft.max_eval_examples``)."""
    from rlhf_train.tasks.movie_reviews.data import sft_examples as encode

    s = cfg.sft
    splits = movie_review_splits(cfg.data.seed)
    train, val = splits["sft_train"][: s.max_train_examples], splits["validation"][: s.max_eval_examples]
    return encode(tokenizer, train, s.max_len), encode(tokenizer, val, s.max_len)


def preference_pairs(cfg: DictConfig, tokenizer) -> tuple[dict, dict]:
    """(train, validation) pairs ``chosen_input_ids`` ... ``rejected_attention_mask`` ``[P, rm.max_len]``:
    a positive (chosen) and a negative (rejected) review of the ``rm_train`` / ``validation`` split."""
    from rlhf_train.tasks.movie_reviews.data import preference_pairs as pairs

    r = cfg.rm
    splits = movie_review_splits(cfg.data.seed)
    train = pairs(tokenizer, splits["rm_train"], r.max_len, seed=r.seed)
    val = pairs(tokenizer, splits["validation"], r.max_len, seed=r.seed)

    def cut(d: dict, n: int | None) -> dict:
        return {k: v[:n] for k, v in d.items()}

    return cut(train, r.max_train_pairs), cut(val, r.max_eval_pairs)


def judge(cfg: DictConfig):
    """The independent sentiment judge (:class:`~rlhf_train.tasks.movie_reviews.judge.SentimentJudge`),
    trained on the ``judge_train`` reviews (cached in ``cache_dir``); ``None`` when the prompts are not
    movie reviews (it judges review sentiment only)."""
    from rlhf_train.tasks.movie_reviews.judge import train_judge

    if not reads_movie_reviews(cfg):
        log.info("[evaluation] no judge: the movie-review judge reads movie-review prompts only (data=%s)",
                 cfg.data.get("_target_"))
        return None
    return train_judge(movie_review_splits(cfg.data.seed), cfg.cache_dir)


def check_options(cfg: DictConfig) -> None:
    """One ConfigError naming ``data.split`` / ``data.sentiment`` when it is not valid (movie-review prompts only)."""
    from rlhf_train.tasks.movie_reviews.prompts import check_prompt_options

    if reads_movie_reviews(cfg):
        check_prompt_options(cfg.data.split, cfg.data.get("sentiment", "all"))
