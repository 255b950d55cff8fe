"""The base-model fingerprint a checkpoint records (rlhf_train/infra/fingerprint.py): by contents, cheap,
and it says what changed."""
from __future__ import annotations

import json

import torch

from rlhf_train.infra.fingerprint import fingerprint_change, model_fingerprint


def _save(path, seed: int, n_embd: int = 16):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    GPT2LMHeadModel(GPT2Config(vocab_size=32, n_layer=1, n_embd=n_embd, n_head=2, n_positions=32)).save_pretrained(path)


def test_fingerprint_is_by_contents_and_names_what_changed(tmp_path):
    a = tmp_path / "a"
    _save(a, seed=0)
    saved = model_fingerprint(str(a))
    assert saved is not None and set(saved["files"]) == {"model.safetensors"}
    _save(tmp_path / "same", seed=0)  # the same bytes written again (other mtimes, another place): the same model
    assert fingerprint_change(saved, model_fingerprint(str(tmp_path / "same"))) is None
    _save(a, seed=1)  # another model of the same shape in its place
    assert fingerprint_change(saved, model_fingerprint(str(a))) == "its weights differ (same files and sizes, other bytes)"
    _save(a, seed=0, n_embd=32)
    assert "model.safetensors has" in fingerprint_change(saved, model_fingerprint(str(a)))
    _save(a, seed=0)
    config = json.loads((a / "config.json").read_text())
    (a / "config.json").write_text(json.dumps(dict(config, transformers_version="0.0", n_inner=128)))
    assert fingerprint_change(saved, model_fingerprint(str(a))) == "its config.json differs"
    (a / "config.json").write_text(json.dumps(dict(config, transformers_version="0.0")))  # who wrote it: no change
    assert fingerprint_change(saved, model_fingerprint(str(a))) is None
    assert model_fingerprint(None) is None and model_fingerprint(str(tmp_path / "nothing-here")) is None
    assert fingerprint_change(saved, None) == "it no longer names a local model"


def test_fingerprint_sees_one_changed_tensor_anywhere(tmp_path):
    """Each tensor is sampled (start, middle, end): a change confined to one small tensor is seen."""
    from safetensors.torch import load_file, save_file

    a = tmp_path / "a"
    _save(a, seed=0)
    saved = model_fingerprint(str(a))
    weights = load_file(a / "model.safetensors")
    name = sorted(k for k in weights if k.endswith("ln_f.bias"))[0]
    weights[name] = weights[name] + 1.0
    save_file(weights, a / "model.safetensors", metadata={"format": "pt"})
    assert fingerprint_change(saved, model_fingerprint(str(a))) == "its weights differ (same files and sizes, other bytes)"
