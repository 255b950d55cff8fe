"""Prompt datasets for PPO (the ``data`` config group).

Every dataset yields dicts of tensors: ``input_ids [P]`` and ``attention_mask [P]`` (left-padded to a
common width), optionally ``reference_input_ids`` / ``reference_attention_mask`` (prompt + a reference
response, the reward baseline of the TL;DR recipe), and an integer ``index``.
"""
from __future__ import annotations

from rlhf_train.data.prompts import PromptDataset, _limit
from rlhf_train.infra.errors import ConfigError


def movie_review_prompts(tokenizer, split: str = "test", min_prompt_tokens: int = 8, max_prompt_tokens: int = 16,
                         max_prompts: int | None = None, seed: int = 0,
                         prompt_baseline: bool = False) -> PromptDataset:
    """First 8–16 tokens of the reviews of one seeded split (default ``test``: never seen by RM or judge).

    ``prompt_baseline``: the prompt alone is also the "reference" sequence, so the reward-shaping stack's
    ``ReferenceBaseline`` pays ``RM(prompt + continuation) - RM(prompt)``: what the continuation added,
    without the prompt's own sentiment (variance the policy cannot act on).
    """
    from rlhf_train.tasks.movie_reviews.data import (
        SPLIT_NAMES,
        load_reviews,
        prompts,
        split_reviews,
    )

    if split not in SPLIT_NAMES:
        raise ConfigError(f"data.split='{split}' is not a movie-review split; choose one of {', '.join(SPLIT_NAMES)}")
    reviews = split_reviews(load_reviews("imdb"), seed=seed)[split]
    reviews = reviews[: _limit(len(reviews), max_prompts)]
    p = prompts(tokenizer, reviews, min_tokens=min_prompt_tokens, max_tokens=max_prompt_tokens, seed=seed)
    if prompt_baseline:  # left-padded prompt as the reference sequence (the RM reads positions from the mask)
        return PromptDataset(p["input_ids"], p["attention_mask"], p["input_ids"], p["attention_mask"], text=p["text"])
    return PromptDataset(p["input_ids"], p["attention_mask"], text=p["text"])
