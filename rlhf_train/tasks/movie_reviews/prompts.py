"""Prompt datasets for PPO (the ``data`` config group).

Every dataset yields dicts of tensors: ``input_ids [P]`` and ``attention_mask [P]`` (left-padded to a
common width), optionally ``reference_input_ids`` / ``reference_attention_mask`` (prompt + a reference
response, the reward baseline of the TL;DR recipe), and an integer ``index``.
"""
from __future__ import annotations

from rlhf_train.data.prompts import PromptDataset, _limit
from rlhf_train.infra.errors import ConfigError

SENTIMENTS = ("all", "negative", "positive")


def check_prompt_options(split: str, sentiment: str = "all") -> None:
    """One ConfigError naming the key, before any work, for a split or sentiment that does not exist."""
    from rlhf_train.tasks.movie_reviews.data import SPLIT_NAMES

    if split not in SPLIT_NAMES:
        raise ConfigError(f"data.split='{split}' is not a movie-review split; choose one of {', '.join(SPLIT_NAMES)}")
    if sentiment not in SENTIMENTS:
        raise ConfigError(f"data.sentiment='{sentiment}' is not valid; choose one of {', '.join(SENTIMENTS)}")


def movie_review_prompts(tokenizer, split: str = "test", min_prompt_tokens: int = 8, max_prompt_tokens: int = 16,
                         max_prompts: int | None = None, seed: int = 0,
                         prompt_baseline: bool = False, sentiment: str = "all") -> PromptDataset:
    """First 8–16 tokens of the reviews of one seeded split (default ``test``: never seen by RM or judge).

    ``sentiment``: ``all`` reviews, or only the ``negative`` (or ``positive``) ones. The embedded default
    (``conf/recipe/default.yaml``, SmolLM2) opens with negative reviews: a pretrained model continues them
    mostly in their own tone, so turning them positive is a change a reader sees in the samples.

    ``prompt_baseline``: the prompt alone is also the "reference" sequence, so the reward-shaping stack's
    ``ReferenceBaseline`` pays ``RM(prompt + continuation) - RM(prompt)``: what the continuation added,
    without the prompt's own sentiment (variance the policy cannot act on).
    """
    from rlhf_train.tasks.movie_reviews.data import load_reviews, prompts, split_reviews

    check_prompt_options(split, sentiment)
    reviews = split_reviews(load_reviews("imdb"), seed=seed)[split]
    if sentiment != "all":  # labels: 1 positive, 0 negative
        reviews = [r for r in reviews if int(r.label) == int(sentiment == "positive")]
    reviews = reviews[: _limit(len(reviews), max_prompts)]
    p = prompts(tokenizer, reviews, min_tokens=min_prompt_tokens, max_tokens=max_prompt_tokens, seed=seed)
    if prompt_baseline:  # left-padded prompt as the reference sequence (the RM reads positions from the mask)
        return PromptDataset(p["input_ids"], p["attention_mask"], p["input_ids"], p["attention_mask"], text=p["text"])
    return PromptDataset(p["input_ids"], p["attention_mask"], text=p["text"])
