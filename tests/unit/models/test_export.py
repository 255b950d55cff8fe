"""The trained policy as a plain Hugging Face model (issue 13, item 5).

At the end of a run ``<run dir>/policy/`` holds the LM (``save_pretrained``: weights, config, generation
config), the tokenizer and the value head beside them; each checkpoint's ``policy/`` is the same kind of
dir (full fine-tuning). Both load with ``AutoModelForCausalLM.from_pretrained`` and generate through
``transformers.pipeline("text-generation", ...)`` in a fresh interpreter that never imports rlhf_train.
(LoRA's export, merged model + adapter, is tested in tests/unit/models/test_lora.py.)

Budget: ~12 s on 2 quiet CPU cores (~6 s of it the subprocess importing transformers).
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.reliability import make_cfg

PLAIN_LOAD = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, pipeline

out = {}
for name, path in (("export", sys.argv[1]), ("checkpoint", sys.argv[2])):
    model = AutoModelForCausalLM.from_pretrained(path)
    pipe = pipeline("text-generation", model=path, device="cpu")
    text = pipe("this movie was", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    out[name] = {"class": type(model).__name__, "text": text,
                 "eos": pipe.model.generation_config.eos_token_id, "rlhf_train_imported": "rlhf_train" in sys.modules}
print(json.dumps(out))
"""


def test_plain_export_loads_and_generates_without_rlhf_train(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlhf_train.loop.trainer import train

    out = train(make_cfg("logger=none", "trainer.num_iterations=1"), tmp_path)
    policy, tokenizer = out["policy"], out["run"].tokenizer
    export, ckpt = tmp_path / "policy", tmp_path / "checkpoints" / "iter_000001" / "policy"
    for d in (export, ckpt):
        assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
            p.name for p in d.iterdir()}, sorted(p.name for p in d.iterdir())
    # the exported weights are the trained ones, bit for bit; the value head is beside them
    loaded = AutoModelForCausalLM.from_pretrained(export)
    trained = policy.lm.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in loaded.state_dict().items())
    value_head = load_file(export / "value_head.safetensors")
    assert torch.equal(value_head["summary.weight"], policy.value_head.summary.weight)
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id

    # a fresh interpreter with plain transformers only: load + pipeline("text-generation")
    res = subprocess.run([sys.executable, "-c", PLAIN_LOAD, str(export), str(ckpt)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("export", "checkpoint"):
        assert got[name]["class"] == type(policy.lm).__name__ and not got[name]["rlhf_train_imported"]
        assert got[name]["text"].strip() and got[name]["eos"] == tokenizer.eos_token_id
    assert got["export"]["text"] == got["checkpoint"]["text"]  # the last checkpoint holds the same model

    # on request (`python -m rlhf_train.tools.export CKPT OUT`): the checkpoint's plain dir + the value head
    from rlhf_train.tools.export import export_checkpoint

    out_dir = export_checkpoint(ckpt.parent, tmp_path / "exported")
    for name in ("model.safetensors", "value_head.safetensors"):
        assert (out_dir / name).read_bytes() == (export / name).read_bytes(), name


def test_export_replaces_an_earlier_export_atomically_and_nothing_else(tmp_path):
    from rlhf_train.infra.errors import ConfigError
    from rlhf_train.infra.export_dir import EXPORT_MARKER
    from rlhf_train.models.export import export_policy
    from tests.helpers.reliability import tiny_policy

    policy = tiny_policy()
    export_policy(policy, None, tmp_path / "policy")
    (tmp_path / "policy" / "stale.txt").write_text("from an earlier export")
    export_policy(policy, None, tmp_path / "policy")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["policy"]  # no .tmp-/.old- dirs left behind
    assert not (tmp_path / "policy" / "stale.txt").exists() and (tmp_path / "policy" / "model.safetensors").is_file()
    (tmp_path / "policy" / EXPORT_MARKER).unlink()  # no longer recognisably an export: never replaced
    with pytest.raises(ConfigError, match="holds files that are not an rlhf_train export"):
        export_policy(policy, None, tmp_path / "policy")
    assert (tmp_path / "policy" / "model.safetensors").is_file()


def _log_probs(lm, ids):
    with torch.no_grad():
        return torch.log_softmax(lm(input_ids=ids).logits.float(), dim=-1)


def test_lora_on_a_tied_lm_head_exports_the_trained_policy(tmp_path):
    """Tied embeddings + LoRA on ``lm_head``: every export computes the trained policy's log-probs, the merged
    models (end of run, ``tools.export`` of the last checkpoint) and the adapters on their base alike."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from rlhf_train.loop.trainer import train
    from rlhf_train.tools.export import main
    from tests.unit.models.test_lora import LORA, STAND_INS

    torch.manual_seed(0)
    base = tmp_path / "tied_llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 eos_token_id=0, bos_token_id=0, pad_token_id=1,
                                 tie_word_embeddings=True)).save_pretrained(base)
    cfg = make_cfg(*LORA, *STAND_INS, f"policy.pretrained={base}", "policy.lora.target_modules=[q_proj,v_proj,lm_head]",
                   "trainer.num_iterations=2", "trainer.checkpoint_every=2", "optimizer.lr=3e-2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's warnings about adapting a tied layer
        out = train(cfg, tmp_path / "run")
        lm = out["policy"].lm
        ids = torch.tensor([[5, 9, 3, 12, 7, 20, 4, 2], [2, 8, 7, 20, 5, 5, 9, 30]])
        trained = _log_probs(lm, ids)
        with lm.disable_adapter():
            assert (_log_probs(lm, ids) - trained).abs().max() > 0.05  # the adapter changed the policy visibly
        assert main([str(tmp_path / "run" / "checkpoints" / "iter_000002"), str(tmp_path / "exported")]) == 0
        for export in (tmp_path / "run" / "policy", tmp_path / "exported"):
            merged = AutoModelForCausalLM.from_pretrained(export)
            gap = (_log_probs(merged, ids) - trained).abs().max().item()
            assert gap < 1e-4, (export, gap)
            assert not merged.config.tie_word_embeddings
            adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), export / "adapter")
            assert (_log_probs(adapter, ids) - trained).abs().max() < 1e-4, export
    assert lm.get_base_model().lm_head.base_layer.weight is lm.get_base_model().model.embed_tokens.weight
