"""Offline data for the embedded-default sentiment pipeline (see :mod:`rlhf_train.data.movie_reviews`).

``movie_reviews.prompts`` is not re-exported here: ``rlhf_train.data.prompts`` is the prompt-dataset
module (``_target_: rlhf_train.data.prompts.movie_review_prompts``), and a function of the same name
on the package would hide it from Hydra's ``instantiate`` until something imports the module.
"""

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
    "sft_examples",
    "split_reviews",
    "train_tokenizer",
]
