"""Tokenizer factories for the ``tokenizer`` config group."""
from __future__ import annotations

from rlhf_train.errors import ConfigError


def validate_tokenizer(tokenizer, override: str):
    """EOS is required (responses end there); pad falls back to EOS only when the tokenizer has none."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer has no EOS token; use a tokenizer with an eos_token (set {override})")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style: pad == EOS, masks tell them apart
    return tokenizer


def movie_reviews_tokenizer(vocab_size: int = 8192, cache_dir: str | None = None, seed: int = 0, **_):
    """The embedded default's byte-level BPE, trained on the ``sft_train`` reviews (cached)."""
    from rlhf_train.data.movie_reviews import load_reviews, split_reviews, train_tokenizer

    splits = split_reviews(load_reviews("imdb"), seed=seed)
    tok = train_tokenizer([r.text for r in splits["sft_train"]], vocab_size=vocab_size, cache_dir=cache_dir)
    return validate_tokenizer(tok, "tokenizer=...")


def pretrained_tokenizer(pretrained: str, trust_remote_code: bool = False, **_):
    """A Hugging Face tokenizer from a local dir, or a hub name already in the local cache."""
    from transformers import AutoTokenizer

    from rlhf_train.models import check_loadable

    path = check_loadable(pretrained, "tokenizer.pretrained", "tokenizer")
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return validate_tokenizer(tok, "tokenizer.pretrained")
