"""The independent sentiment judge for the embedded-default pipeline.

PPO optimises the *learned* reward model, so the reward model's own score cannot tell whether
the policy learned positive sentiment or learned to exploit the reward model. The judge is a
deliberately different model, trained on different data:

* bag of words (TF-IDF over lower-cased unigrams + bigrams, sublinear tf) + logistic regression,
  not a transformer over the pipeline's BPE tokens;
* fitted on the ``judge_train`` split only, which is disjoint from ``rm_train`` (and from
  ``sft_train``), so it never saw a review the reward model was trained on.

Training text: whole reviews. Measured on the IMDB validation split (1,244 reviews, split
seed 0, C=4, all 3,736 judge_train reviews), accuracy on [whole review / first 60 / first 30 /
first 20 words]:

* trained on whole reviews:        0.885 / 0.776 / 0.729 / 0.705
* trained on the first 60 words:   0.856 / 0.752 / 0.700 / 0.694
* trained on the first 30 words:   0.834 / 0.738 / 0.705 / 0.701

Truncating the training text never helped on short text (differences on short text are within
the ~1.3-point standard error), and hurt on whole reviews, so the default is no truncation;
``max_words`` exists to redo the comparison. Short-prefix accuracy is low mostly because the
first words of a review are often plot summary with no sentiment in them.

Persistence is one ``.npz`` (vocabulary as a unicode array, idf, coefficients, intercept and a
JSON config), loaded with ``allow_pickle=False``: no pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from rlhf_train.infra.cache_entries import remove_stale_temps, temp_file, writable_dir

__all__ = ["SentimentJudge", "train_judge"]

_FORMAT_VERSION = 1


def _first_words(text: str, n: int | None) -> str:
    return text if n is None else " ".join(text.split()[:n])


def _digest(texts: Sequence[str], labels: Sequence[int]) -> str:
    h = hashlib.sha256()
    for t, y in zip(texts, labels):
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
        h.update(b"\x01" if int(y) else b"\x00")
    return h.hexdigest()


class SentimentJudge:
    """TF-IDF (1-2 grams) + logistic regression sentiment classifier; label 1 = positive."""

    def __init__(
        self,
        C: float = 4.0,
        ngram_range: tuple[int, int] = (1, 2),
        min_df: int = 2,
        max_features: int | None = 100_000,
        sublinear_tf: bool = True,
        max_words: int | None = None,
    ) -> None:
        self.C = float(C)
        self.ngram_range = (int(ngram_range[0]), int(ngram_range[1]))
        self.min_df = min_df
        self.max_features = max_features
        self.sublinear_tf = bool(sublinear_tf)
        self.max_words = max_words  # truncate *training* texts to their first max_words words
        self._vectorizer = None
        self.coef_: np.ndarray | None = None
        self.intercept_: float = 0.0
        self.train_digest: str | None = None  # sha256 of the (text, label) pairs it was fitted on
        self.n_train: int = 0

    # ---------------------------------------------------------------------------------------
    def _make_vectorizer(self, vocabulary=None):
        from sklearn.feature_extraction.text import TfidfVectorizer

        return TfidfVectorizer(
            lowercase=True,
            ngram_range=self.ngram_range,
            min_df=self.min_df if vocabulary is None else 1,
            max_features=self.max_features if vocabulary is None else None,
            sublinear_tf=self.sublinear_tf,
            vocabulary=vocabulary,
            dtype=np.float64,
        )

    @property
    def fitted(self) -> bool:
        return self._vectorizer is not None and self.coef_ is not None

    def fit(self, texts: Sequence[str], labels: Sequence[int]) -> SentimentJudge:
        from sklearn.linear_model import LogisticRegression

        texts, labels = list(texts), [int(y) for y in labels]
        if len(texts) != len(labels) or not texts:
            raise ValueError("fit needs equally many (>0) texts and labels")
        if set(labels) != {0, 1}:
            raise ValueError("labels must contain both 0 and 1")
        vec = self._make_vectorizer()
        X = vec.fit_transform([_first_words(t, self.max_words) for t in texts])
        lr = LogisticRegression(C=self.C, solver="liblinear", max_iter=1000).fit(X, np.asarray(labels))
        self._vectorizer = vec
        self.coef_ = np.asarray(lr.coef_[0], dtype=np.float64)
        self.intercept_ = float(lr.intercept_[0])
        self.train_digest = _digest(texts, labels)
        self.n_train = len(texts)
        return self

    def _check(self) -> None:
        if not self.fitted:
            raise RuntimeError("SentimentJudge is not fitted; call fit() or load()")

    def decision_function(self, texts: Sequence[str]) -> np.ndarray:
        self._check()
        texts = list(texts)
        if not texts:
            return np.zeros(0, dtype=np.float64)
        X = self._vectorizer.transform(texts)
        return np.asarray(X @ self.coef_, dtype=np.float64).ravel() + self.intercept_

    def positive_prob(self, texts: Sequence[str]) -> np.ndarray:
        """P(positive) per text, float64 array of shape [len(texts)]."""
        z = self.decision_function(texts)
        return 1.0 / (1.0 + np.exp(-z))

    def positive_rate(self, texts: Sequence[str], threshold: float = 0.5) -> float:
        """Fraction of texts judged positive (``positive_prob > threshold``); nan for no texts."""
        p = self.positive_prob(texts)
        return float(np.mean(p > threshold)) if p.size else float("nan")

    def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
        p = self.positive_prob(texts)
        y = np.asarray([int(v) for v in labels])
        if p.shape != y.shape:
            raise ValueError("texts and labels differ in length")
        return float(np.mean((p > 0.5).astype(int) == y)) if y.size else float("nan")

    # ---------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {
            "format_version": _FORMAT_VERSION,
            "C": self.C,
            "ngram_range": list(self.ngram_range),
            "min_df": self.min_df,
            "max_features": self.max_features,
            "sublinear_tf": self.sublinear_tf,
            "max_words": self.max_words,
            "intercept": self.intercept_,
            "train_digest": self.train_digest,
            "n_train": self.n_train,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write one ``.npz`` (atomically: temp file + ``os.replace``). No pickle."""
        self._check()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        vocab = self._vectorizer.vocabulary_
        terms = [""] * len(vocab)
        for term, i in vocab.items():
            terms[i] = term
        # Terms are word n-grams joined by single spaces (no newlines): store them as one
        # newline-joined UTF-8 byte array, far smaller than a fixed-width unicode array.
        blob = np.frombuffer("\n".join(terms).encode("utf-8"), dtype=np.uint8)
        fd, tmp = temp_file(path)  # named after this process; its mode is the umask's, like every other file
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(
                    f,
                    terms=blob,
                    idf=np.asarray(self._vectorizer.idf_, dtype=np.float64),
                    coef=self.coef_,
                    config=np.array(json.dumps(self._config())),
                )
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> SentimentJudge:
        with np.load(path, allow_pickle=False) as z:
            cfg = json.loads(str(z["config"]))
            if cfg.get("format_version") != _FORMAT_VERSION:
                raise ValueError(f"{path}: unsupported judge format {cfg.get('format_version')}")
            terms, idf, coef = z["terms"], z["idf"], z["coef"]
        judge = cls(
            C=cfg["C"],
            ngram_range=tuple(cfg["ngram_range"]),
            min_df=cfg["min_df"],
            max_features=cfg["max_features"],
            sublinear_tf=cfg["sublinear_tf"],
            max_words=cfg["max_words"],
        )
        term_list = terms.tobytes().decode("utf-8").split("\n") if terms.size else []
        if len(term_list) != len(coef) or len(idf) != len(coef):
            raise ValueError(f"{path}: corrupt judge file (vocabulary/coef/idf sizes differ)")
        vec = judge._make_vectorizer(vocabulary={t: i for i, t in enumerate(term_list)})
        vec.idf_ = idf
        judge._vectorizer = vec
        judge.coef_ = np.asarray(coef, dtype=np.float64)
        judge.intercept_ = float(cfg["intercept"])
        judge.train_digest = cfg["train_digest"]
        judge.n_train = int(cfg["n_train"])
        return judge


def train_judge(
    splits: Mapping[str, Sequence],
    cache_dir: str | os.PathLike | None = None,
    *,
    max_train: int | None = None,
    **judge_kwargs,
) -> SentimentJudge:
    """Fit a :class:`SentimentJudge` on ``splits["judge_train"]`` (only), cached on disk.

    ``max_train`` keeps the first ``max_train`` judge_train reviews (the split is already
    shuffled), for fast tests. The cache file ``cache_dir/judge-<hash>.npz`` is keyed by the
    training (text, label) digest and the judge's hyper-parameters; ``cache_dir=None`` uses
    :func:`rlhf_train.tasks.movie_reviews.bpe.default_cache_dir`.
    """
    from rlhf_train.tasks.movie_reviews.bpe import default_cache_dir

    reviews = list(splits["judge_train"])
    if max_train is not None:
        reviews = reviews[:max_train]
    texts = [r.text for r in reviews]
    labels = [int(r.label) for r in reviews]
    proto = SentimentJudge(**judge_kwargs)
    cfg = {k: v for k, v in proto._config().items() if k not in ("intercept", "train_digest", "n_train")}
    key = hashlib.sha256(
        (json.dumps(cfg, sort_keys=True) + "|" + _digest(texts, labels)).encode()
    ).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"judge-{key}.npz"
    if path.is_file():
        return SentimentJudge.load(path)
    writable_dir(cache)  # one line naming RLHF_TRAIN_CACHE, before the fit, not a traceback after it
    remove_stale_temps(cache)  # a save into the cache that was killed left its temp file
    judge = proto.fit(texts, labels)
    judge.save(path)
    return judge
