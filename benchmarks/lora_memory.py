"""Peak memory and iteration time of PPO, full fine-tuning vs LoRA, same batch, on SmolLM2-135M's shape.

The policy is a randomly initialised Llama of SmolLM2-135M's shape (30 layers, width 576, 9 heads / 3
KV heads, MLP 1536, vocabulary 49152, tied embeddings: 134.5 M parameters, 538 MB in float32), saved
once to a temp dir and loaded by path (``policy.pretrained``). Each mode runs in a fresh process (so
each peak is its own) through the trainer itself (``rlhf_train.loop.trainer.train``, the smoke recipe
with the shapes below): full fine-tuning (policy + a frozen reference copy + AdamW over every weight)
vs ``policy.lora.r=16`` (one copy of the weights; the reference is the policy with its adapter
disabled; AdamW over the adapter and the value head). Prompts are random tokens (``data=synthetic``),
the reward a stand-in that needs no model, so the numbers are the policy's and the reference's.

Measured per mode: ``peak_rss_mb`` (the process's peak resident memory over setup and every iteration;
the final checkpoint and export are skipped so they cannot set it), ``iteration_s`` (median of the
iterations after the first), ``params_trainable``, ``ref_copy_mb`` (the reference's weights: 0 with
LoRA), and in the summary line ``saved_mb`` = full − LoRA peak against ``reference_weights_mb``.
Prints one JSON line per mode and a summary line; ``--out FILE`` also writes them as a JSON list.

    python benchmarks/lora_memory.py --out lora_memory.json     # ~4 min on 2 CPU cores
"""
from __future__ import annotations

import os

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from standin import StandInTokenizer  # noqa: E402  (benchmarks/ is not a package)

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                    tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0)


def stand_in_tokenizer(**_):
    return StandInTokenizer(SMOLLM2_135M["vocab_size"])


class StandInReward(torch.nn.Module):
    """Reward = fraction of even token ids (no weights: the memory measured is the policy's)."""

    def __init__(self, **_):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(()), requires_grad=False)  # gives the module a device

    def forward(self, input_ids, attention_mask):
        even = ((input_ids % 2 == 0) & attention_mask.bool()).float() + self.anchor
        return even, even.sum(-1) / attention_mask.sum(-1).clamp(min=1)


def build_model_dir(path: Path, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    vocab = SMOLLM2_135M["vocab_size"]
    cfg = LlamaConfig(**SMOLLM2_135M, eos_token_id=vocab - 1, bos_token_id=vocab - 1, pad_token_id=vocab - 1)
    LlamaForCausalLM(cfg).save_pretrained(path)


def run_mode(a) -> dict:
    """One mode in this process: the trainer on the saved model; its JSON line."""
    from hydra import compose, initialize_config_dir

    import rlhf_train.data.prompts  # noqa: F401  (as the CLI does before instantiating cfg.data)
    from rlhf_train.config.schema import register_configs
    from rlhf_train.loop import trainer

    torch.set_num_threads(a.threads)
    register_configs()
    overrides = [
        "+recipe=smoke", "logger=none", "trainer.progress_bar=false", f"policy.pretrained={a.model_dir}",
        "tokenizer._target_=lora_memory.stand_in_tokenizer", "reward_model._target_=lora_memory.StandInReward",
        "data=synthetic", f"data.batch_size={a.batch}", f"data.min_prompt_tokens={a.prompt_len // 2}",
        f"data.max_prompt_tokens={a.prompt_len}", f"data.max_prompts={a.batch * a.iterations}",
        f"rollout.max_new_tokens={a.new_tokens}", f"update.num_epochs={a.epochs}", f"update.minibatch_size={a.minibatch}",
        f"trainer.num_iterations={a.iterations}", "trainer.checkpoint_every=100000", "trainer.samples_every=100000",
        f"trainer.num_threads={a.threads}", "trainer.cpu=true",
        f"policy.lora.r={a.rank if a.mode == 'lora' else 0}", f"policy.lora.alpha={2 * a.rank}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    # the training iterations only: the final checkpoint and export are timed and sized elsewhere
    trainer.save_checkpoint = lambda *args, **kwargs: None
    trainer.export_policy = lambda *args, **kwargs: None
    with tempfile.TemporaryDirectory() as run_dir:
        out = trainer.train(cfg, run_dir)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = [h["time/iteration_s"] for h in out["history"]]
    reference = out["rollout"].reference
    policy = out["policy"]
    ref = reference.model if reference is not None and reference.kind == "copy" else None  # a copy costs memory
    return {
        "mode": a.mode, "lora_r": a.rank if a.mode == "lora" else 0,
        "peak_rss_mb": round(peak, 1),
        "iteration_s": round(statistics.median(times[1:] or times), 2), "iteration_s_all": [round(t, 2) for t in times],
        "params_total": sum(p.numel() for p in policy.parameters()),
        "params_trainable": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "ref_copy_mb": round(sum(p.numel() * p.element_size() for p in ref.parameters()) / 2**20, 1) if ref else 0.0,
        "first_kl": out["history"][0]["objective/kl"],
        "shape": {"batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "epochs": a.epochs,
                  "minibatch": a.minibatch, "threads": a.threads, "model": "SmolLM2-135M shape (Llama), random"},
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8, help="prompts per iteration (both modes)")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt (tokens)")
    p.add_argument("--new-tokens", type=int, default=32, help="response tokens")
    p.add_argument("--epochs", type=int, default=1, help="PPO epochs per iteration")
    p.add_argument("--minibatch", type=int, default=4, help="sequences per optimizer step")
    p.add_argument("--iterations", type=int, default=3, help="PPO iterations per mode (the first is not timed)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank r (alpha = 2r)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--out", help="also write the JSON lines to this file (a list)")
    p.add_argument("--mode", choices=["full", "lora"], help=argparse.SUPPRESS)  # the child process
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mode:
        print(json.dumps(run_mode(a)), flush=True)
        return
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        build_model_dir(Path(tmp) / "model", seed=0)
        for mode in ("full", "lora"):
            args = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--model-dir", str(Path(tmp) / "model"),
                    *[x for k, v in vars(a).items() if k not in ("mode", "model_dir", "out") and v is not None
                      for x in (f"--{k.replace('_', '-')}", str(v))]]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")]))
            res = subprocess.run(args, capture_output=True, text=True, env=env, cwd=REPO)
            if res.returncode != 0:
                sys.exit(f"{mode} failed:\n{res.stderr[-3000:]}")
            line = json.loads(res.stdout.strip().splitlines()[-1])
            print(json.dumps(line), flush=True)
            lines.append(line)
    full, lora = lines
    ref_mb = round(full["params_total"] * 4 / 2**20, 1)  # float32 weights of the reference copy
    summary = {"saved_mb": round(full["peak_rss_mb"] - lora["peak_rss_mb"], 1), "reference_weights_mb": ref_mb,
               "lora_saves_at_least_the_reference": full["peak_rss_mb"] - lora["peak_rss_mb"] >= ref_mb,
               "iteration_speedup": round(full["iteration_s"] / lora["iteration_s"], 2)}
    print(json.dumps(summary), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps([*lines, summary], indent=1) + "\n")


if __name__ == "__main__":
    main()
