"""Tokenizer factories for the ``tokenizer`` config group."""
from __future__ import annotations

from rlhf_train.data.tokenizers import validate_tokenizer


def movie_reviews_tokenizer(vocab_size: int = 8192, cache_dir: str | None = None, seed: int = 0):
    """The from-scratch sentiment pipeline's byte-level BPE, trained on the ``sft_train`` reviews (cached)."""
    from rlhf_train.tasks.movie_reviews.bpe import train_tokenizer
    from rlhf_train.tasks.movie_reviews.data import load_reviews, split_reviews

    splits = split_reviews(load_reviews("imdb"), seed=seed)
    tok = train_tokenizer([r.text for r in splits["sft_train"]], vocab_size=vocab_size, cache_dir=cache_dir)
    return validate_tokenizer(tok, "tokenizer=...")
