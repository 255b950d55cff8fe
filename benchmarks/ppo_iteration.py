"""One PPO iteration of rlhf_train (rollout + update) on a randomly initialised GPT-2 built from config
(``--algorithm grpo|rloo|reinforce_pp --num-samples K``: one iteration of that algorithm at the same shapes).

Runs the trainer's own code: the Hydra config is composed from ``conf/`` (``data=synthetic``, shapes as
overrides), ``rlhf_train.loop.build.build_run`` builds the run from it, and one iteration is the loop's
own ``rlhf_train.loop.trainer.step``:

  1. ``RolloutFromModel`` (the KV-cached decode loop, which also yields the policy's log-probs and values
     → one pass each of reference and reward model → the shaping stack),
  2. the algorithm's estimator (``rlhf_train.algorithms.ppo.GAE``: GAE + ``global_masked_whiten``),
  3. ``rlhf_train.algorithms.update.minibatch_update`` (``num_epochs`` × minibatches of ``--minibatch`` sequences),
  4. the KL controller's update with the per-sequence KLs.

Prints one JSON line: ``rollout_s`` (step 1), ``generate_s`` (time inside the generation backend),
``update_s`` (step 3), ``total_s`` (steps 1-5), ``gen_tokens`` (response tokens, EOS included),
``tokens_per_s`` (gen_tokens / total_s), ``peak_rss_mb``; also ``rollout_peak_rss_mb`` (the process's
peak at the end of the first rollout, before any update), ``cpu_s`` (process CPU time of the
iteration), the floor accounting (:mod:`flops`: ``rollout_gflop`` and ``update_gflop``, the matmul FLOPs
of each; ``gemm_gflop_per_s``, this machine's rate on the iteration's largest GEMM (the LM head of a
minibatch), measured in the same process before the models are built (its buffers stay out of the peak RSS); ``rollout_floor_ratio``, ``update_floor_ratio``, ``iteration_floor_ratio``: time / (FLOPs
/ that rate), 1.0 = at the floor), ``update_gflop_per_s`` and ``first_ratio`` (the first
minibatch's PPO ratio: 1). ``--warmup`` untimed iterations come first (default 1: a training run is
many iterations); ``--repeats N`` times N iterations and prints the median one.

Shapes follow torchrl's ``examples/rlhf`` (see ``benchmarks/torchrl_example.py``): prompts of
``prompt_len/2 … prompt_len`` tokens, each with a reference continuation ("summary") of
``new_tokens/2 … new_tokens`` tokens that the reward model scores as the baseline, as torchrl does.
Every iteration generates all ``--rollouts`` at once, as the trainer does.

    python benchmarks/ppo_iteration.py --layers 2 --width 128 --vocab 50257 --batch 4 \\
        --new-tokens 50 --rollouts 32 --epochs 3 --minibatch 16

GRPO at the same shapes: the same 32 rollouts per iteration, as 8 prompts × 4 samples (``algorithm.beta``
0.04: a reference pass, no value head; ``--grpo-beta 0`` drops the reference too). The JSON then also
holds ``algorithm`` and ``num_samples``:

    python benchmarks/ppo_iteration.py --layers 2 --width 128 --vocab 50257 --batch 4 \\
        --new-tokens 50 --rollouts 32 --epochs 3 --minibatch 16 --algorithm grpo --num-samples 4

``--shape NAME`` takes a shape of ``benchmarks/shapes.py`` with ``compare_trl.py``'s settings for
``--algorithm`` (``--shape smollm2 --algorithm grpo``: SmolLM2-135M's shape, 8 prompts × 4 samples, 1 epoch,
β 0.04); ``--no-reference-responses`` leaves the prompts without reference continuations (no baseline pass of
the reward model: what TRL's trainers run; ``--shape`` implies it).
"""
from __future__ import annotations

import os

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flops  # noqa: E402  (benchmarks/ is not a package)
from shapes import ALGORITHMS, SHAPES  # noqa: E402
from standin import StandInTokenizer  # noqa: E402

from rlhf_train.compat.torchrl import to_torchrl  # noqa: E402

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*, layers, width, heads, vocab, prompt_len, new_tokens, rollouts, epochs, minibatch, threads,
                   seed, num_prompts=None, algorithm="ppo", num_samples=1, extra=(), llama=None):
    """The trainer's Hydra config for this shape (``conf/`` + overrides), type-checked by the schemas.

    ``llama``: ``{"kv_heads", "intermediate", "reward_model_dir"}`` for a Llama-architecture policy (SmolLM2's
    shape) and a Llama sequence-classification reward model saved at ``reward_model_dir``; else GPT-2s."""
    from hydra import compose, initialize_config_dir

    from rlhf_train.config.schema import register_configs

    register_configs()
    n_positions = max(1024, prompt_len + 2 * new_tokens)
    model = [f"config.n_layer={layers}", f"config.n_embd={width}", f"config.n_head={heads}",
             f"config.n_positions={n_positions}"]
    models = ["policy=tiny_gpt2", "reward_model=tiny_gpt2", *[f"policy.{m}" for m in model],
              *[f"reward_model.{m}" for m in model]]
    if llama is not None:
        models = ["policy=tiny_gpt2", *[f"~policy.config.{k}" for k in ("n_layer", "n_embd", "n_head", "n_positions")],
                  "+policy.config.model_type=llama", f"+policy.config.num_hidden_layers={layers}",
                  f"+policy.config.hidden_size={width}", f"+policy.config.num_attention_heads={heads}",
                  f"+policy.config.num_key_value_heads={llama['kv_heads']}",
                  f"+policy.config.intermediate_size={llama['intermediate']}",
                  f"+policy.config.max_position_embeddings={n_positions}", "+policy.config.tie_word_embeddings=true",
                  "reward_model=pretrained", f"reward_model.pretrained={llama['reward_model_dir']}"]
    overrides = [
        "data=synthetic", "logger=none", *models,
        "kl_controller=adaptive",  # AdaptiveKLController(0.1, 6, 10000), as the torchrl example
        f"algorithm={algorithm}", f"rollout.num_samples={num_samples}", *extra,
        f"data.batch_size={rollouts // num_samples}", f"data.min_prompt_tokens={max(1, prompt_len // 2)}",
        f"data.max_prompt_tokens={prompt_len}", f"data.max_prompts={num_prompts or rollouts}", f"data.seed={seed}",
        f"rollout.max_new_tokens={new_tokens}",
        f"update.num_epochs={epochs}", f"update.minibatch_size={minibatch}", "algorithm.gamma=0.99",
        "algorithm.lam=0.95",
        f"trainer.num_threads={threads}", "trainer.cpu=true", f"trainer.seed={seed}",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=overrides)


def add_reference_continuations(dataset, new_tokens: int, vocab: int, special: int, seed: int) -> None:
    """Give each prompt a random reference continuation of ``new_tokens/2 … new_tokens`` tokens.

    Stored as ``reference_input_ids / reference_attention_mask [N, P + new_tokens]`` (prompt, then the
    continuation right-padded): the reward model scores them as the baseline, like torchrl's labels.
    """
    g = torch.Generator().manual_seed(seed + 1)
    ids, mask = dataset.tensors["input_ids"], dataset.tensors["attention_mask"].bool()
    n = ids.shape[0]
    lengths = torch.randint(max(1, new_tokens // 2), new_tokens + 1, (n,), generator=g)
    label_mask = torch.arange(new_tokens)[None] < lengths[:, None]
    labels = torch.randint(0, special, (n, new_tokens), generator=g).masked_fill(~label_mask, special)
    dataset.tensors["reference_input_ids"] = torch.cat([ids, labels], dim=1)
    dataset.tensors["reference_attention_mask"] = torch.cat([mask, label_mask], dim=1).long()


class _GenerateTimer:
    """Wraps a generation backend's ``generate`` (instance attribute) and accumulates the seconds spent inside it."""

    def __init__(self, backend):
        self.lm, self.seconds, self._orig = backend, 0.0, backend.generate

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self._orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t

        backend.generate = timed

    def remove(self):
        del self.lm.generate


class _RolloutProbe:
    """Stands in for ``run.rollout``: the process's peak RSS when the rollout returns (before the update)."""

    def __init__(self, rollout):
        self.inner, self.rss_kb = rollout, 0

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self.rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def build(cfg, tokenizer):
    """The trainer's run (``build_run``, minus run dir, logging and checkpoints) and a fresh training state."""
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.state import TrainState

    run = build_run(cfg, tokenizer=tokenizer)
    run.rollout = _RolloutProbe(run.rollout)
    state = TrainState.fresh(run.kl_controller, cfg.trainer.seed, 0, cfg.trainer.max_consecutive_faults)
    return run, state


def one_iteration(run, state, prompts: dict) -> dict:
    """The loop's ``step`` on one batch of prompts; returns its timings (seconds) and the rollout."""
    from rlhf_train.loop.trainer import step

    timer = _GenerateTimer(run.rollout.backend)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    try:
        metrics, ro = step(run, state, prompts)
    finally:
        timer.remove()
    ru2 = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (ru2.ru_utime - ru0.ru_utime) + (ru2.ru_stime - ru0.ru_stime)
    return {"rollout_s": metrics["time/rollout_s"], "generate_s": timer.seconds, "update_s": metrics["time/update_s"],
            "total_s": metrics["time/iteration_s"], "cpu_s": cpu_s, "rollout_peak_rss_mb": run.rollout.rss_kb / 1024,
            "gen_tokens": int(ro.masks.response.sum()), "first_ratio": metrics["val/first_ratio"], "rollout": ro}


def prompt_share(update, B: int, width: int, device, samples: int) -> float:
    """Rows per prompt pass in the update: a minibatch's rows ordered by prompt (``samples`` each), split into
    ``update.micro_batch_tokens`` slices, each slice running each prompt it holds once."""
    from rlhf_train.algorithms.micro_batches import micro_batch_tokens

    mbs = min(update.minibatch_size, B)
    budget = micro_batch_tokens(update, device)
    count = 1 if budget is None else min(mbs, max(1, -(-mbs * width // budget)))
    passes = sum(len(set((rows // samples).tolist())) for rows in torch.tensor_split(torch.arange(mbs), count))
    return mbs / passes


class RLHFTrainBenchmark:
    """Builds the trainer's components once; :meth:`run` times one more PPO iteration on fresh prompts."""

    def __init__(self, *, layers: int = 2, width: int = 128, heads: int = 4, vocab: int = 50257,
                 prompt_len: int = 64, new_tokens: int = 50, rollouts: int = 32, epochs: int = 3,
                 minibatch: int = 16, threads: int = 2, seed: int = 0,
                 max_iterations: int = 16, algorithm: str = "ppo", num_samples: int = 1, extra=(),
                 arch: str = "gpt2", kv_heads: int = 3, intermediate: int = 1536, reference_responses: bool = True):
        torch.set_num_threads(threads)
        if rollouts % num_samples:
            raise ValueError(f"--rollouts {rollouts} must be a multiple of --num-samples {num_samples}")
        # the floor's GEMM rate, measured once before anything is built: its buffers (~1 GB at SmolLM2's shape)
        # would otherwise raise the process's peak RSS above the iteration's own, which is the one reported
        self.gemm_rate = flops.gemm_gflop_per_s(width, vocab, minibatch * new_tokens)
        self.rollouts, self.num_samples = rollouts, num_samples
        self.cfg = compose_config(layers=layers, width=width, heads=heads, vocab=vocab, prompt_len=prompt_len,
                                  new_tokens=new_tokens, rollouts=rollouts, epochs=epochs, minibatch=minibatch,
                                  threads=threads, seed=seed, num_prompts=rollouts * max_iterations,
                                  algorithm=algorithm, num_samples=num_samples, extra=extra,
                                  llama=self._llama_reward_model(arch, layers, width, heads, kv_heads, intermediate,
                                                                 vocab))
        tokenizer = StandInTokenizer(vocab)
        self.run_, self.train_state = build(self.cfg, tokenizer)
        if reference_responses:  # the reward model scores them too: the baseline (torchrl's labels)
            add_reference_continuations(self.run_.dataset, new_tokens, vocab, tokenizer.eos_token_id, seed)
        self.order = torch.randperm(len(self.run_.dataset), generator=torch.Generator().manual_seed(seed))
        self.iterations = 0

    def _llama_reward_model(self, arch, layers, width, heads, kv_heads, intermediate, vocab):
        """``--arch llama``: a random Llama sequence classifier of the policy's shape, saved to a temp dir
        (the reward model, as TRL's side has one); ``None`` for GPT-2."""
        if arch == "gpt2":
            return None
        import tempfile

        from transformers import AutoModelForSequenceClassification, LlamaConfig

        self._tmp = tempfile.TemporaryDirectory()
        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                          num_labels=1, pad_token_id=vocab - 1, eos_token_id=vocab - 1, bos_token_id=vocab - 1)
        AutoModelForSequenceClassification.from_config(cfg).save_pretrained(self._tmp.name)
        return {"kv_heads": kv_heads, "intermediate": intermediate, "reward_model_dir": self._tmp.name}

    def run(self) -> dict:
        """One iteration (steps 2-5) on the next ``rollouts`` prompts: the JSON fields."""
        from rlhf_train.data.prompts import collate

        k, R = self.iterations, self.rollouts // self.num_samples  # prompts (each sampled num_samples times)
        if (k + 1) * R > len(self.order):
            raise RuntimeError("RLHFTrainBenchmark: out of prompts; raise max_iterations")
        prompts = collate([self.run_.dataset[int(i)] for i in self.order[k * R:(k + 1) * R]])
        self.iterations += 1
        r = one_iteration(self.run_, self.train_state, prompts)
        run, update = self.run_, self.run_.decisions.update
        policy_lm = run.accelerator.unwrap_model(run.policy).lm
        td = to_torchrl(r["rollout"])  # the flop counts read torchrl's keys
        if k == 0:  # before any update: setup + one rollout
            self.first_rollout_rss = r["rollout_peak_rss_mb"]
        backend, reference = run.rollout.backend, run.rollout.reference
        B = td.batch_size[0]
        rows = update.num_epochs * (B // update.minibatch_size) * update.minibatch_size
        loop_drives = getattr(backend, "drives", lambda: False)()  # one prefill per prompt, shared by its samples
        policy_pass = run.rollout.trainer_pass or not backend.with_scores  # the policy's own scoring pass runs
        # trainer.shared_prompt: the scoring passes run each prompt once for its samples, the update once per
        # micro-batch that holds some of them (a minibatch's rows ordered by prompt, then split)
        shared = self.num_samples if self.cfg.trainer.shared_prompt else 1
        update_shared = prompt_share(update, B, td["tokens", "full"].shape[1], run.accelerator.device, shared)
        gflop_rollout = flops.rollout_flops(policy_lm, reference.model if reference is not None else None,
                                            run.reward_model, td, policy_pass=policy_pass,
                                            num_samples=self.num_samples if loop_drives else 1,
                                            shared_prompt=shared) / 1e9
        gflop_update = flops.update_flops(policy_lm, td, rows, shared_prompt=update_shared) / 1e9
        floor = {k_: g / self.gemm_rate for k_, g in (("rollout", gflop_rollout), ("update", gflop_update))}
        return {
            "impl": "rlhf_train",
            "algorithm": self.cfg.algorithm.name,
            "num_samples": self.num_samples,
            "rollout_s": round(r["rollout_s"], 3),
            "generate_s": round(r["generate_s"], 3),
            "update_s": round(r["update_s"], 3),
            "total_s": round(r["total_s"], 3),
            "gen_tokens": r["gen_tokens"],
            "tokens_per_s": round(r["gen_tokens"] / r["total_s"], 2),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "rollout_peak_rss_mb": round(self.first_rollout_rss, 1),  # process peak at the end of the first rollout
            "cpu_s": round(r["cpu_s"], 3),
            # the floor: matmul FLOPs / the rate of this machine's largest GEMM (benchmarks/flops.py)
            "rollout_gflop": round(gflop_rollout, 1),
            "update_gflop": round(gflop_update, 1),
            "gemm_gflop_per_s": round(self.gemm_rate, 1),
            "update_gflop_per_s": round(gflop_update / r["update_s"], 1),
            "rollout_floor_ratio": round(r["rollout_s"] / floor["rollout"], 2),
            "update_floor_ratio": round(r["update_s"] / floor["update"], 2),
            "iteration_floor_ratio": round(r["total_s"] / (floor["rollout"] + floor["update"]), 2),
            "first_ratio": round(r["first_ratio"], 6),
        }


def median_run(runs: list[dict]) -> dict:
    """The run with the median ``total_s`` (upper median), with every run's ``total_s`` attached."""
    best = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
    return {**best, "repeats": len(runs), "total_s_all": [r["total_s"] for r in runs]}


def run_rlhf_train_iteration(*, layers: int = 2, width: int = 128, heads: int = 4, vocab: int = 50257,
                             prompt_len: int = 64, batch: int = 4, new_tokens: int = 50, rollouts: int = 32,
                             epochs: int = 3, minibatch: int = 16, threads: int = 2, seed: int = 0,
                             warmup: int = 1, repeats: int = 1, algorithm: str = "ppo",
                             num_samples: int = 1, extra=(), arch: str = "gpt2", kv_heads: int = 3,
                             intermediate: int = 1536, reference_responses: bool = True) -> dict:
    """Build everything, run ``warmup`` untimed iterations, then time ``repeats`` more; returns the JSON
    dict of the median one (by ``total_s``).

    ``batch`` is the torchrl example's prompts per collection step (rlhf_train generates all at once).
    """
    del batch  # the trainer generates all `rollouts` prompts of an iteration in one batch by default
    bench = RLHFTrainBenchmark(layers=layers, width=width, heads=heads, vocab=vocab, prompt_len=prompt_len,
                               new_tokens=new_tokens, rollouts=rollouts, epochs=epochs, minibatch=minibatch,
                               threads=threads, seed=seed, max_iterations=warmup + repeats,
                               algorithm=algorithm, num_samples=num_samples, extra=extra, arch=arch,
                               kv_heads=kv_heads, intermediate=intermediate, reference_responses=reference_responses)
    for _ in range(warmup):
        bench.run()
    runs = [bench.run() for _ in range(repeats)]
    return runs[0] if repeats == 1 else median_run(runs)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--width", type=int, default=128, help="hidden size n_embd")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=50257, help="vocabulary size (EOS = pad = vocab - 1)")
    p.add_argument("--prompt-len", type=int, default=64, help="max prompt tokens (min is half)")
    p.add_argument("--batch", type=int, default=4, help="prompts per collection step of the torchrl example (rlhf_train generates all at once)")
    p.add_argument("--new-tokens", type=int, default=50, help="max new tokens per response (T)")
    p.add_argument("--rollouts", type=int, default=32, help="sequences per iteration")
    p.add_argument("--epochs", type=int, default=3, help="PPO epochs")
    p.add_argument("--minibatch", type=int, default=16, help="sequences per PPO minibatch")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before the timed ones")
    p.add_argument("--repeats", type=int, default=1, help="timed iterations; the median (by total_s) is printed")
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2",
                   help="llama: a Llama policy (SmolLM2-135M's shape with --layers 30 --width 576 --heads 9 "
                        "--vocab 49152) and a Llama sequence-classification reward model")
    p.add_argument("--kv-heads", type=int, default=3, help="llama: key/value heads")
    p.add_argument("--intermediate", type=int, default=1536, help="llama: MLP width")
    p.add_argument("--algorithm", default="ppo", help="ppo | grpo | rloo | reinforce_pp | reinforce_pp_baseline")
    p.add_argument("--num-samples", type=int, default=1,
                   help="completions per prompt (rollouts / this prompts per iteration; grpo / rloo need >= 2)")
    p.add_argument("--grpo-beta", type=float, default=None, help="algorithm.beta (GRPO's KL in the loss; 0: no reference)")
    p.add_argument("--override", action="append", default=[],
                   help="an extra Hydra override, e.g. generation=hf_generate (repeatable)")
    p.add_argument("--no-reference-responses", action="store_true",
                   help="no reference continuations: the reward model scores the responses alone (as TRL)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="a shape of benchmarks/shapes.py with compare_trl.py's settings for --algorithm "
                        "(replaces the shape, epoch, minibatch, sample and beta flags; no reference responses)")
    return p


def benchmark_from_args(a, max_iterations: int) -> RLHFTrainBenchmark:
    """The :class:`RLHFTrainBenchmark` of :func:`parser`'s parsed flags (after :func:`apply_shape`)."""
    return RLHFTrainBenchmark(
        layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, prompt_len=a.prompt_len,
        new_tokens=a.new_tokens, rollouts=a.rollouts, epochs=a.epochs, minibatch=a.minibatch, threads=a.threads,
        seed=a.seed, max_iterations=max_iterations, algorithm=a.algorithm, num_samples=a.num_samples,
        extra=([f"algorithm.beta={a.grpo_beta}"] if a.grpo_beta is not None else []) + a.override,
        arch=a.arch, kv_heads=a.kv_heads, intermediate=a.intermediate,
        reference_responses=not a.no_reference_responses)


def apply_shape(a) -> None:
    """``--shape``: the named shape and ``--algorithm``'s settings, as ``compare_trl.py`` runs them."""
    if a.shape is None:
        return
    for key, value in {**SHAPES[a.shape], **ALGORITHMS.get(a.algorithm, {})}.items():
        setattr(a, "grpo_beta" if key == "beta" else key, value)
    a.no_reference_responses = True


def main(argv=None):
    a = parser().parse_args(argv)
    apply_shape(a)
    print(json.dumps(run_rlhf_train_iteration(
        layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, prompt_len=a.prompt_len, batch=a.batch,
        new_tokens=a.new_tokens, rollouts=a.rollouts, epochs=a.epochs, minibatch=a.minibatch, threads=a.threads,
        seed=a.seed, warmup=a.warmup, repeats=a.repeats, algorithm=a.algorithm,
        num_samples=a.num_samples,
        extra=([f"algorithm.beta={a.grpo_beta}"] if a.grpo_beta is not None else []) + a.override,
        arch=a.arch, kv_heads=a.kv_heads, intermediate=a.intermediate,
        reference_responses=not a.no_reference_responses)))


if __name__ == "__main__":
    main()
