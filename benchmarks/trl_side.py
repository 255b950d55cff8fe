"""TRL's side of ``benchmarks/compare_trl.py``: PPO iterations of ``trl.experimental.ppo.PPOTrainer`` or
``trl.GRPOTrainer`` at one shape, on randomly initialised models built from config. Prints one JSON line.

Runs inside TRL's own virtualenv (``compare_trl.py`` creates it), so it imports nothing of rlhf_train.
Models: policy, reference, value model and reward model of one architecture (``--arch gpt2``: GPT-2 with
``--layers``/``--width``; ``--arch llama``: SmolLM2-135M's shape unless overridden), random weights. The
tokenizer is a word-level one over ``--vocab`` made-up tokens (EOS = pad = ``vocab - 1``), the prompts are
random ids of ``prompt_len/2 … prompt_len`` tokens (as ``benchmarks/ppo_iteration.py`` draws them).

Precision: float32, as rlhf_train's side. TRL's configs default to ``bf16=True``, under which ``transformers``'
``Trainer`` autocasts to bfloat16 on a CPU that has bfloat16 instructions (this VM's AMD EPYC does): the
update's products then run in bfloat16. Both trainers here set ``bf16=False``; ``--bf16`` keeps TRL's default.
Measured 2026-11-30 (GRPO at SmolLM2-135M's shape, rlhf_train's CPU settings): 39.2 s an iteration in
float32 against 18.2 s under TRL's default.

Timing: a ``TrainerCallback`` stamps ``time.perf_counter()`` at the start of training and at the end of
every iteration (TRL's PPO calls ``on_step_end`` once per rollout + update; ``GRPOTrainer`` once per
optimizer step, which with ``steps_per_generation=1`` is one generation + one update). The first
``--warmup`` iterations are dropped; the printed ``total_s`` is the median of the rest.
"""
from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time


def tokenizer_for(vocab: int):
    """A fast tokenizer over ``vocab`` word-level tokens ``t0 … t{vocab-2}`` + ``<eos>`` (id ``vocab-1``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 1)}
    words["<eos>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>", bos_token="<eos>")
    out.padding_side = "left"
    return out


def configs(a):
    """``(causal LM config, sequence-classification config)`` of the shape."""
    from transformers import GPT2Config, LlamaConfig

    special = dict(vocab_size=a.vocab, eos_token_id=a.vocab - 1, pad_token_id=a.vocab - 1, bos_token_id=a.vocab - 1)
    if a.arch == "gpt2":
        make = lambda **kw: GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=a.heads, resid_pdrop=0.0,  # noqa: E731
                                      embd_pdrop=0.0, attn_pdrop=0.0, n_positions=1024, **special, **kw)
    else:
        make = lambda **kw: LlamaConfig(num_hidden_layers=a.layers, hidden_size=a.width,  # noqa: E731
                                       num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                                       intermediate_size=a.intermediate, max_position_embeddings=2048,
                                       tie_word_embeddings=True, **special, **kw)
    return make(), make(num_labels=1)


def prompts(a, n: int):
    import torch

    g = torch.Generator().manual_seed(a.seed)
    lengths = torch.randint(max(1, a.prompt_len // 2), a.prompt_len + 1, (n,), generator=g)
    rows = [torch.randint(0, a.vocab - 1, (int(n_),), generator=g).tolist() for n_ in lengths]
    return rows


class Stamps:
    """A ``TrainerCallback`` recording the time of training start and of every ``on_step_end``."""

    def __init__(self):
        from transformers import TrainerCallback

        stamps = self.stamps = []

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                stamps.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kw):
                stamps.append(time.perf_counter())

        self.callback = _CB()

    def iteration_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])][warmup:]


def run_ppo(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    lm_cfg, cls_cfg = configs(a)
    torch.manual_seed(a.seed)
    policy = AutoModelForCausalLM.from_config(lm_cfg)
    ref = AutoModelForCausalLM.from_config(lm_cfg)
    ref.load_state_dict(policy.state_dict())
    value = AutoModelForSequenceClassification.from_config(cls_cfg)
    reward = AutoModelForSequenceClassification.from_config(cls_cfg)
    iterations = a.warmup + a.repeats
    data = Dataset.from_dict({"input_ids": prompts(a, a.rollouts * iterations)})
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as out:
        args = PPOConfig(
            output_dir=out, per_device_train_batch_size=a.rollouts, gradient_accumulation_steps=1,
            num_mini_batches=a.rollouts // a.minibatch, num_ppo_epochs=a.epochs, response_length=a.new_tokens,
            local_rollout_forward_batch_size=a.rollouts, total_episodes=a.rollouts * iterations,
            num_sample_generations=0, report_to=[], logging_steps=10**6, save_strategy="no", use_cpu=True,
            seed=a.seed, stop_token="eos", dataloader_num_workers=0, bf16=a.bf16,
        )
        trainer = PPOTrainer(args=args, processing_class=tokenizer_for(a.vocab), model=policy, ref_model=ref,
                             reward_model=reward, value_model=value, train_dataset=data, callbacks=[stamps.callback])
        trainer.train()
    return {"impl": "trl_ppo", "times": stamps.iteration_times(a.warmup)}


def run_grpo(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    lm_cfg, cls_cfg = configs(a)
    torch.manual_seed(a.seed)
    policy = AutoModelForCausalLM.from_config(lm_cfg)
    reward = AutoModelForSequenceClassification.from_config(cls_cfg)
    tok = tokenizer_for(a.vocab)
    iterations = a.warmup + a.repeats
    n_prompts = a.rollouts // a.num_samples
    texts = [" ".join(f"t{i}" for i in row) for row in prompts(a, n_prompts * iterations)]
    data = Dataset.from_dict({"prompt": texts})
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as out:
        # GRPOTrainer builds its reference (beta > 0) from the policy's path: save the random policy first
        policy.save_pretrained(f"{out}/policy")
        tok.save_pretrained(f"{out}/policy")
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=a.rollouts, gradient_accumulation_steps=1,
            num_generations=a.num_samples, num_iterations=a.epochs, steps_per_generation=1,
            max_completion_length=a.new_tokens, beta=a.beta, max_steps=iterations, report_to=[],
            logging_steps=10**6, save_strategy="no", use_cpu=True, seed=a.seed, dataloader_num_workers=0, bf16=a.bf16,
        )
        trainer = GRPOTrainer(model=f"{out}/policy", reward_funcs=[reward], args=args, train_dataset=data,
                              processing_class=tok, reward_processing_classes=[tok], callbacks=[stamps.callback])
        trainer.train()
    return {"impl": "trl_grpo", "times": stamps.iteration_times(a.warmup)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=["ppo", "grpo"], default="ppo")
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=50)
    p.add_argument("--rollouts", type=int, default=32, help="sequences per iteration")
    p.add_argument("--num-samples", type=int, default=4, help="GRPO: completions per prompt")
    p.add_argument("--epochs", type=int, default=3, help="PPO epochs (GRPO: num_iterations)")
    p.add_argument("--minibatch", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.04, help="GRPO: KL coefficient (> 0 loads a reference)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="TRL's default: bfloat16 autocast (else float32)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    out = run_ppo(a) if a.algo == "ppo" else run_grpo(a)
    times = sorted(out["times"])
    out.update(total_s=round(times[len(times) // 2], 3), total_s_all=[round(t, 3) for t in out.pop("times")],
               peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    import trl

    out["trl_version"] = trl.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main()
