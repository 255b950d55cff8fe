"""Loading a dataset by name or path, for the prompt datasets (``prompts``, ``hf_prompts``) and the pipeline.

:func:`load_hf_dataset`: a ``save_to_disk`` dir, a local path ``datasets`` can read, or a hub name (one
quick check that the Hub is reachable or the name is in the local cache, instead of ``datasets``' ~25 s of
retries offline). :func:`load_any`: also a single ``.json`` / ``.jsonl`` / ``.csv`` / ``.parquet`` file or a
dir of them, and whether the result came with splits. :func:`holdout`: a dataset without splits keeps its
last rows out of training for the evaluation's split. Bad input is one ``ConfigError`` line. Local files are
read into memory (:func:`load_in_memory`): no Arrow copy of them is left in ``datasets``' cache.
"""
from __future__ import annotations

import logging
import os

from rlhf_train.data.files import FORMATS as _FORMATS
from rlhf_train.data.files import check_files, data_files, json_error
from rlhf_train.infra.errors import ConfigError

log = logging.getLogger(__name__)


def _hub_reachable(timeout: float = 2.0) -> bool:
    """One quick TCP connect instead of ``datasets``' retries (~25 s) when the Hub is unreachable."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _in_datasets_cache(name: str) -> bool:
    import datasets

    cache = os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE))
    return os.path.isdir(os.path.join(cache, name.replace("/", "___")))


def load_in_memory(*args, **kwargs):
    """``datasets.load_dataset`` of local data, kept in memory, leaving no copy of the data on disk.

    ``datasets`` converts local files to Arrow under its cache (``~/.cache/huggingface/datasets``), a lasting
    copy of the user's data outside the run dir and the project's cache. Here its cache is a private scratch
    dir (mode 0700, in the system temp dir, ``TMPDIR``) removed before this returns, also on error: the same
    parsing, types and errors as ``datasets``' own, and the rows in memory."""
    import tempfile

    import datasets

    with tempfile.TemporaryDirectory(prefix="rlhf_train-data-") as scratch:
        return datasets.load_dataset(*args, cache_dir=scratch, keep_in_memory=True, **kwargs)


def load_hf_dataset(name: str, split: str, config: str | None = None):
    """``datasets.load_dataset`` (or ``load_from_disk`` for a saved dir) that fails fast when offline;
    ``config``: the hub dataset's configuration (``openai/gsm8k``'s ``main``)."""
    import datasets

    path = os.path.expanduser(name)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        return datasets.load_from_disk(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
        return datasets.load_from_disk(path)[split]
    if os.path.exists(path):
        try:
            return load_in_memory(path, split=split)
        except Exception as err:  # e.g. a dir with no data files datasets can read
            raise ConfigError(f"cannot load dataset '{name}' (split '{split}'): {type(err).__name__}: "
                              f"{str(err)[:200]}") from None
    call = f"datasets.load_dataset('{name}'{f', {config!r}' if config else ''}).save_to_disk(DIR)"
    if not _hub_reachable() and not _in_datasets_cache(name):
        raise ConfigError(
            f"cannot load dataset '{name}' (split '{split}'): no network and not in the local datasets cache. "
            f"Save it with `{call}` on a machine with network access and set data.dataset=DIR")
    try:
        return datasets.load_dataset(name, config, split=split, download_mode="reuse_cache_if_exists")
    except Exception as err:  # offline, or unknown name
        raise ConfigError(
            f"cannot load dataset '{name}' (split '{split}'): not a local path and not reachable/cached "
            f"({type(err).__name__}). Save it with `{call}` on a machine with network access and set "
            f"data.dataset=DIR"
        ) from None


def load_any(dataset: str, split: str, key: str = "data.dataset"):
    """``(datasets.Dataset, has_splits)`` from a file, a dir of files, a ``save_to_disk`` dir or a cached hub name."""
    import datasets

    path = os.path.expanduser(str(dataset))
    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path):
        if ext not in _FORMATS:
            raise ConfigError(f"{key}={dataset}: unknown file type '{ext}'; use .json, .jsonl, .csv or .parquet")
        return _read_files(_FORMATS[ext], path, dataset, key), False
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_info.json")):
            return datasets.load_from_disk(path), False
        if os.path.exists(os.path.join(path, "dataset_dict.json")):
            dd = datasets.load_from_disk(path)
            if split not in dd:
                raise ConfigError(f"{key}={dataset} has no split '{split}' (has {list(dd)}); set data.split")
            return dd[split], True
        files = data_files(path, key, dataset)  # raises for a dir with no data files
        if files:
            fmt = _FORMATS[os.path.splitext(files[0])[1].lower()]
            return _read_files(fmt, files, dataset, key), False
    elif ext in _FORMATS or path.startswith(("/", ".", "~")):
        raise ConfigError(f"{key}={dataset}: no such file or directory")
    return load_hf_dataset(str(dataset), split), True


def _read_files(fmt: str, files, dataset: str, key: str):
    check_files([files] if isinstance(files, str) else files, key, dataset)  # 0 bytes, not UTF-8: one line
    builders = logging.getLogger("datasets.packaged_modules")  # its "Failed to load JSON" log line: ours replaces it
    level = builders.level
    builders.setLevel(logging.CRITICAL)
    try:
        return load_in_memory(fmt, data_files=files, split="train")
    except Exception as err:  # a malformed row, ...
        where = next(filter(None, map(json_error, [files] if isinstance(files, str) else files)), None) \
            if fmt == "json" else None  # datasets names a character position: find the line
        if where:
            raise ConfigError(f"{key}={dataset}: {where}") from None
        if "no data" in str(err):
            raise ConfigError(f"{key}={dataset} has no rows") from None
        raise ConfigError(f"{key}={dataset}: cannot read it as {fmt} ({type(err).__name__}: {str(err)[:200]})") from None
    finally:
        builders.setLevel(level)


def holdout(ds, has_splits: bool, split: str, eval_holdout: int):
    """A dataset without splits: split ``train`` is all but its last ``eval_holdout`` rows (at most half),
    any other split (the evaluation's, e.g. ``test`` / ``valid``) those rows, so evaluation never sees
    training prompts (:func:`rows_line` says how many)."""
    if has_splits or eval_holdout <= 0:
        return ds
    n = len(ds)
    k = min(int(eval_holdout), n // 2)
    return ds.select(range(n - k, n)) if split != "train" else ds.select(range(n - k))


def rows_line(dataset: str, split: str, has_splits: bool, total: int, held: int, used: int,
              max_prompts: int | None, holdout_key: str = "data.eval_holdout", shuffled: bool = False) -> str:
    """The one line a prompt dataset logs at start: how many rows the data has, how many are held out for
    evaluation (a dataset without splits) and how many this split uses (``data.max_prompts``)::

        [data] 1,000 rows in prompts.jsonl; holding out the last 64 for evaluation (data.eval_holdout); using 256
        of the other 936 (data.max_prompts=256)

    ``total``: rows in the data (or in the split); ``held``: rows held out (0: none); ``used``: rows taken."""
    where = f"split '{split}' of {dataset}" if has_splits else dataset
    parts = [f"[data] {total:,} rows in {where}"]
    rest = total if has_splits or not held else total - held if split == "train" else held
    if not has_splits and split != "train":
        parts.append(f"evaluating on the last {held:,} (held out of training by {holdout_key})" if held else
                     f"none held out ({holdout_key}=0): evaluating on every row, the training rows too")
    elif not has_splits:
        parts.append(f"holding out the last {held:,} for evaluation ({holdout_key})" if held
                     else f"none held out for evaluation ({holdout_key}=0)")
    if used < rest:
        of = "" if has_splits or not held else f" of the other {rest:,}" if split == "train" else " of them"
        after = ", after a shuffle (data.seed)" if shuffled else ""
        parts.append(f"using {used:,}{of} (data.max_prompts={max_prompts}{after})")
    elif not has_splits and split == "train" and held:
        parts.append(f"training on the other {rest:,}")
    return "; ".join(parts)
