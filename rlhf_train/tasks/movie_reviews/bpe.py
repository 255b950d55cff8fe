"""The from-scratch sentiment pipeline's tokenizer: a byte-level BPE trained locally on movie reviews, cached on disk.

Trained with the ``tokenizers`` library (no network), wrapped as a ``transformers``
``PreTrainedTokenizerFast`` and saved under :func:`default_cache_dir` keyed by a hash of its recipe
and training texts, so every later run reloads the same tokenizer instead of retraining it.
The config-group factory that picks the training texts is
:func:`rlhf_train.tasks.movie_reviews.tokenizer.movie_reviews_tokenizer`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from rlhf_train.infra.cache_entries import writable_dir
from rlhf_train.infra.checkpoint import apply_umask

__all__ = ["EOS_TOKEN", "PAD_TOKEN", "default_cache_dir", "texts_digest", "train_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

# Bump when the tokenizer recipe changes, so old cache entries are not reused.
_TOKENIZER_CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """``$RLHF_TRAIN_CACHE`` or ``~/.cache/rlhf_train``."""
    env = os.environ.get("RLHF_TRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "rlhf_train"


def texts_digest(texts: Iterable[str]) -> str:
    """sha256 over the texts (length-prefixed, so boundaries count)."""
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _build_tokenizer_object(texts: Sequence[str], vocab_size: int, min_frequency: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _wrap(tok_obj):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok_obj,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="right",
        truncation_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int = 8192,
    cache_dir: str | os.PathLike | None = None,
    *,
    min_frequency: int = 2,
):
    """Train (or reload from cache) a byte-level BPE tokenizer on ``texts``.

    Special tokens: ``<|endoftext|>`` (id 0) is EOS and also BOS; ``<|pad|>`` (id 1) is pad.
    Padding side is **right** (what SFT / reward-model batches want); :func:`~rlhf_train.tasks.movie_reviews.data.prompts` builds its
    left-padded batch itself, and generation code should set ``padding_side="left"`` locally.
    No special tokens are added by ``tokenizer(...)`` (there is no post-processor): append EOS
    explicitly, as :func:`~rlhf_train.tasks.movie_reviews.data.sft_examples` does. Decoding round-trips text exactly.

    The result is saved with ``save_pretrained`` under
    ``cache_dir/tokenizer-<hash>``, hash over (recipe version, vocab_size, min_frequency,
    number of texts, sha256 of the texts), and later calls reload it with
    ``AutoTokenizer.from_pretrained`` instead of retraining. The entry is written into a
    temporary directory next to it and moved into place with ``os.replace``, so a crash never
    leaves a half-written entry. ``cache_dir=None`` uses :func:`default_cache_dir`.
    """
    from transformers import AutoTokenizer

    texts = list(texts)
    if not texts:
        raise ValueError("train_tokenizer needs at least one text")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(
        f"v{_TOKENIZER_CACHE_VERSION}|{vocab_size}|{min_frequency}|{len(texts)}|{texts_digest(texts)}".encode()
    ).hexdigest()[:16]
    final = cache / f"tokenizer-{key}"
    if (final / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(final))

    writable_dir(cache)  # one line naming RLHF_TRAIN_CACHE before training, not a traceback from mkdir after it
    tokenizer = _wrap(_build_tokenizer_object(texts, vocab_size, min_frequency))
    tmp = Path(tempfile.mkdtemp(prefix=f".tokenizer-{key}-", dir=cache))
    try:
        tokenizer.save_pretrained(str(tmp))
        apply_umask(tmp)  # mkdtemp makes the dir 0700: use the umask's modes, like every other file
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race and ``final`` is a non-empty directory: use theirs.
            if not (final / "tokenizer.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(str(final))
