"""Offline data for the embedded-default sentiment pipeline (see :mod:`rlhf_train.data.movie_reviews`)."""

from rlhf_train.data.movie_reviews import (
    EOS_TOKEN,
    PAD_TOKEN,
    SPLIT_FRACTIONS,
    SPLIT_NAMES,
    Review,
    clean_text,
    default_cache_dir,
    load_reviews,
    preference_pairs,
    prompts,
    sft_examples,
    split_reviews,
    train_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPLIT_FRACTIONS",
    "SPLIT_NAMES",
    "Review",
    "clean_text",
    "default_cache_dir",
    "load_reviews",
    "preference_pairs",
    "prompts",
    "sft_examples",
    "split_reviews",
    "train_tokenizer",
]
