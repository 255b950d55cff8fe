"""PPO and GRPO iterations of rlhf_train at real model shapes, on a GPU (or, ``--device cpu --tiny``, a toy
run of the same code): tokens/s, MFU, the step split and peak memory per (shape, algorithm, full / LoRA,
precision). Prints one JSON object; ``--out FILE`` also writes it there after every row.

    python benchmarks/gpu.py                                   # every shape x ppo,grpo x full,lora x fp32,bf16,fp16
    python benchmarks/gpu.py --models qwen2.5_0.5b --dtypes fp32,bf16 --out gpu.json
    python benchmarks/gpu.py --device cpu --tiny               # SmolLM2's architecture at toy sizes, fp32 + bf16

The run is the trainer's own: the Hydra config composed from ``conf/`` (``data=synthetic``, the shape and
settings as overrides), ``rlhf_train.loop.build.build_run`` builds it and one iteration is
``rlhf_train.loop.trainer.step`` (rollout -> advantages -> update -> KL controller). The models are random
(no download), built from the Hugging Face config hyper-parameters of :data:`MODELS`; the tokenizer is a
stand-in over the model's vocabulary (EOS = pad = the last id), prompts are random ids. The reward is a
small random reward model (a GPT-2 trunk, :data:`REWARD_MODEL`, on the same vocabulary) so that the reward
phase is a real forward pass without dominating the step.

Workload per iteration (defaults): 64 sequences (PPO: 64 prompts; GRPO: 16 prompts x 4 samples, beta 0.04
so a reference pass runs), prompts of 64-128 tokens (left-padded to 128), 128 new tokens at temperature 1,
1 epoch of minibatches of 32 sequences; ``--warmup`` untimed iterations, then ``--iterations`` timed ones
(their sums are reported). LoRA: rank 16, alpha 32, every linear layer but the LM head; the reference is
then the policy with its adapter off.

Precision (``--dtypes``), what the product offers today:
  fp32   everything float32 (CUDA matmuls at torch's default precision, ``highest``: no TF32)
  bf16   ``trainer.mixed_precision=bf16``: Accelerate's autocast around the prepared policy's forward and
         the reference pass; weights, optimizer and log-probs stay float32
  fp16   ``trainer.mixed_precision=fp16``: the same with float16 autocast and a gradient scaler
  bf16w  ``policy.dtype=bfloat16``: the policy's weights (and so its copy, the reference) in bfloat16
Which dtype each phase's matmuls actually ran in is recorded per row (``matmul_dtypes``: the output dtype
of the policy's and the reference's first linear layer, seen by a forward hook).

Step split (``split_s``, seconds per iteration; CUDA is synchronised at every boundary): ``generate`` (the
generation backend), ``policy_score`` (the policy's own no-grad log-prob pass: runs under mixed precision
and with LoRA, where the log-probs do not come from the generation steps), ``reference`` (the reference's
log-prob pass), ``reward`` (the reward sources), ``update`` (the minibatch update) and ``other`` (the rest
of ``step``: shaping, advantages, KL controller, metrics).

Throughput: ``gen_tok_per_s`` = response tokens / generate seconds; ``trained_tok_per_s`` = response tokens
x epochs (the tokens that carry a loss) / update seconds; ``iteration_tok_per_s`` = response tokens / step
seconds. FLOPs are ``benchmarks/flops.py``'s count of the padded shapes (weight matmuls + attention + the LM
head at the positions that use it, 2 per multiply-add): generation (one prefill per prompt when the decode
loop drives), forward-only passes x 1, the update x 3 (full: forward + two backward matmuls) or x 2 (LoRA: no
weight gradients of the frozen matmuls). ``mfu`` = FLOPs / seconds / the GPU's dense peak for the row's
dtype (:data:`PEAK_TFLOPS`; fp32: the non-tensor-core peak unless torch's float32 matmul precision allows
TF32; bf16 / fp16 / bf16w: the 16-bit tensor-core peak, for every phase, whatever ``matmul_dtypes`` says it
ran in); null on a CPU or an unknown GPU. ``peak_mem_gib``: ``torch.cuda.max_memory_allocated`` over
the row (build + iterations); on a CPU ``peak_rss_mib``, the process's peak so far (rows share a process).

A combination that fails keeps its row with ``error`` (type and message) and ``error_where`` (the innermost
frames); the next row runs.
"""
from __future__ import annotations

import os
import sys

from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402  (before torch is imported)

set_cpu_defaults()

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flops  # noqa: E402  (benchmarks/ is not a package)
from standin import StandInTokenizer  # noqa: E402

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# The published models' config hyper-parameters (config.json of each hub repo), built with random weights.
_LLAMA, _QWEN2 = {"model_type": "llama", "hidden_act": "silu"}, {"model_type": "qwen2", "hidden_act": "silu"}
MODELS = {
    "smollm2_135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,  # 134.5 M
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                     "tie_word_embeddings": True},
    "qwen2.5_0.5b": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,  # 494 M
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
    "qwen2.5_1.5b": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,  # 1.54 B
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                     "tie_word_embeddings": True},
}
# --tiny: the same architectures (grouped-query attention, tied head) at toy sizes
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}
REWARD_MODEL = {"n_layer": 2, "n_embd": 256, "n_head": 4}  # GPT2Config arguments of the reward model's trunk
_MP = "trainer.mixed_precision="
PRECISIONS = {"fp32": [_MP + "no"], "bf16": [_MP + "bf16"], "fp16": [_MP + "fp16"],
              "bf16w": [_MP + "no", "policy.dtype=bfloat16"]}
# Dense peak TFLOP/s by GPU name (NVIDIA data sheets; no sparsity): (fp32 non-tensor-core, tf32, bf16 / fp16)
_SXM = (66.9, 494.7, 989.4)
PEAK_TFLOPS = {"H100 80GB HBM3": _SXM, "H100 SXM": _SXM, "H200": _SXM, "H100 PCIe": (51.2, 378.0, 756.0),
               "A100": (19.5, 156.0, 312.0)}


def peak_flops(device: torch.device, dtype: str) -> tuple[float | None, str]:
    """``(FLOP/s, what it is)`` of the row's matmuls on this GPU; ``(None, why)`` on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None, "cpu: no MFU"
    name = torch.cuda.get_device_name(device)
    peaks = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    if peaks is None:
        return None, f"{name}: peak unknown"
    if dtype == "fp32":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        return peaks[1 if tf32 else 0] * 1e12, f"{name} {'tf32' if tf32 else 'fp32'} dense"
    return peaks[2] * 1e12, f"{name} {'fp16' if dtype == 'fp16' else 'bf16'} dense"


def compose_config(a, model: str, algo: str, lora: bool, dtype: str, num_prompts: int):
    """The trainer's Hydra config of one row (``conf/`` + overrides, type-checked by the schemas)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from rlhf_train.config.schema import register_configs

    register_configs()
    samples = a.samples if algo != "ppo" else 1
    rm = {**REWARD_MODEL, "n_positions": a.prompt_len + a.new_tokens}
    overrides = [
        "data=synthetic", "logger=none", "policy=tiny_gpt2", "reward_model=tiny_gpt2", f"algorithm={algo}",
        *[f"reward_model.config.{k}={v}" for k, v in rm.items()],
        f"rollout.num_samples={samples}", f"data.batch_size={a.rollouts // samples}",
        f"data.min_prompt_tokens={a.prompt_len // 2}", f"data.max_prompt_tokens={a.prompt_len}",
        f"data.max_prompts={num_prompts}", f"rollout.max_new_tokens={a.new_tokens}",
        f"update.num_epochs={a.epochs}", f"update.minibatch_size={a.minibatch}",
        f"policy.lora.r={16 if lora else 0}", "policy.lora.alpha=32",
        f"trainer.cpu={a.device == 'cpu'}", "trainer.seed=0", *PRECISIONS[dtype],
        *([f"trainer.num_threads={a.threads}"] if a.device == "cpu" else []), *a.override,
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=overrides)
    shape = {**MODELS[model], **(TINY if a.tiny else {})}
    with open_dict(cfg):
        cfg.policy.config = {k: v for k, v in shape.items() if k != "vocab_size"}  # the vocabulary: the tokenizer's
    return cfg, shape["vocab_size"]


class Phases:
    """Times the run's components (wrapping them, no change to rlhf_train) and records which dtype the first
    linear layer of the policy (and of the reference) computed in during each phase."""

    def __init__(self, run, device: torch.device):
        import rlhf_train.loop.trainer as trainer

        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds, self.dtypes, self.current, self.undo = {}, {}, "other", []
        ro = run.rollout
        self._wrap(ro.backend, "generate", "generate")
        self._wrap(ro, "policy_log_probs_and_values", "policy_score")
        if ro.reference is not None:
            self._wrap(ro.reference, "fn", "reference")
        ro.reward_sources = {name: (_Timed(src, self, "reward"), w) for name, (src, w) in ro.reward_sources.items()}
        self.update_fn = trainer.minibatch_update
        trainer.minibatch_update = self.timed(self.update_fn, "update")
        self.undo.append(lambda: setattr(trainer, "minibatch_update", self.update_fn))
        lms = [run.accelerator.unwrap_model(run.policy).lm]
        if ro.reference is not None and ro.reference.model is not None:
            lms.append(ro.reference.model)
        for lm in lms:  # the first Linear of the trunk (under LoRA: the adapted layer's base)
            linear = next(m for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n)
            handle = linear.register_forward_hook(self._hook)
            self.undo.append(handle.remove)

    def _hook(self, module, inputs, output):
        self.dtypes.setdefault(self.current, set()).add(str(output.dtype).removeprefix("torch."))

    def timed(self, fn, phase: str):
        def wrapped(*args, **kwargs):
            outer, self.current = self.current, phase
            self.sync()
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t
                self.current = outer
        return wrapped

    def _wrap(self, obj, attr: str, phase: str):
        fn = getattr(obj, attr)
        setattr(obj, attr, self.timed(fn, phase))
        self.undo.append(lambda: setattr(obj, attr, fn))

    def remove(self):
        for undo in reversed(self.undo):
            undo()


class _Timed:
    """A reward source whose calls are timed (its other attributes, ``overlap`` included, pass through)."""

    def __init__(self, source, phases: Phases, phase: str):
        self.source, self.call = source, phases.timed(source, phase)

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.source, name)


def iteration_flops(run, ro, phases: dict, lora: bool, num_samples: int) -> dict:
    """FLOPs of one iteration by phase (:mod:`flops`' counts of the padded shapes)."""
    u, rollout = run.decisions.update, run.rollout
    pol = flops.shape_of(run.accelerator.unwrap_model(run.policy).lm)
    B, L = ro.tokens.full.shape
    T = ro.masks.response.shape[1]
    drives = getattr(rollout.backend, "drives", lambda: False)()  # one prefill per prompt, shared by its samples
    out = {"generate": B * flops.generate_flops(pol, L - T, T, 1.0 / num_samples if drives else 1.0),
           "update": (2 if lora else 3) * flops.forward_flops(pol, L, T)
           * u.num_epochs * (B // u.minibatch_size) * u.minibatch_size}
    if "policy_score" in phases:
        out["policy_score"] = B * flops.forward_flops(pol, L, T)
    if rollout.reference is not None:
        out["reference"] = B * flops.forward_flops(pol, L, T)
    if run.reward_model is not None:
        out["reward"] = B * flops.forward_flops({**flops.shape_of(run.reward_model), "V": 1}, L, 1)
    return out


def measure(a, model: str, algo: str, lora: bool, dtype: str, device: torch.device) -> dict:
    """Build one row's run, time ``--iterations`` iterations after ``--warmup``; the row's JSON fields."""
    from rlhf_train.loop.build import build_run
    from rlhf_train.loop.state import TrainState
    from rlhf_train.loop.trainer import step

    from accelerate.state import AcceleratorState, GradientState

    # Accelerate's state is process-wide and keeps the first row's precision: start each row afresh
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    iters = a.warmup + a.iterations
    cfg, vocab = compose_config(a, model, algo, lora, dtype, num_prompts=a.rollouts * iters)
    run = build_run(cfg, tokenizer=StandInTokenizer(vocab))
    state = TrainState.fresh(run.kl_controller, 0, 0, cfg.trainer.max_consecutive_faults)
    batches, k = iter(run.loader), cfg.rollout.num_samples
    phases = Phases(run, device)
    try:
        tokens, total_s = 0, 0.0
        for i in range(iters):
            if i == a.warmup:  # the timed iterations start here
                phases.seconds, phases.dtypes, tokens, total_s = {}, {}, 0, 0.0
            phases.sync()
            t = time.perf_counter()
            out = step(run, state, next(batches))
            phases.sync()
            total_s += time.perf_counter() - t
            if out is None:
                raise RuntimeError("the reward source failed: batch skipped")
            metrics, ro = out
            tokens += int(ro.masks.response.sum())
        fl = iteration_flops(run, ro, phases.seconds, lora, k)
        lm = run.accelerator.unwrap_model(run.policy).lm
        n = a.iterations
        split = {p: round(phases.seconds.get(p, 0.0) / n, 4)
                 for p in ("generate", "policy_score", "reference", "reward", "update")}
        split["other"] = round(total_s / n - sum(split.values()), 4)
        peak, peak_what = peak_flops(device, dtype)
        mfu = (lambda f, s: round(f * n / s / peak, 4) if peak and s else None)
        row = {
            "params_m": round(sum(p.numel() for p in lm.parameters()) / 1e6, 1),
            "trainable_m": round(sum(p.numel() for p in run.policy.parameters() if p.requires_grad) / 1e6, 2),
            "rows": int(ro.tokens.full.shape[0]), "prompt_width": int(ro.tokens.prompt.shape[1]),
            "response_tokens": tokens // n, "iteration_s": round(total_s / n, 4), "split_s": split,
            "gen_tok_per_s": round(tokens / phases.seconds["generate"], 1),
            "trained_tok_per_s": round(tokens * run.decisions.update.num_epochs / phases.seconds["update"], 1),
            "iteration_tok_per_s": round(tokens / total_s, 1),
            "tflop_per_iteration": {p: round(f / 1e12, 3) for p, f in fl.items()},
            "mfu": mfu(sum(fl.values()), total_s), "mfu_generate": mfu(fl["generate"], phases.seconds["generate"]),
            "mfu_update": mfu(fl["update"], phases.seconds["update"]), "mfu_peak": peak_what,
            "matmul_dtypes": {p: sorted(d) for p, d in phases.dtypes.items()},
            "first_ratio": round(float(metrics["val/first_ratio"]), 6), "finite_loss": all(  # a precision that breaks the update
                math.isfinite(v) for k, v in metrics.items() if "loss" in k),
            "skipped_updates": int(metrics["faults/skipped_updates"]),  # non-finite gradients (fp16 overflow)
        }
        if device.type == "cuda":
            row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        else:
            row["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        return row
    finally:
        phases.remove()


def machine(device: torch.device, threads: int) -> dict:
    import transformers

    out = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
           "float32_matmul_precision": torch.get_float32_matmul_precision()}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
        out["cuda"] = torch.version.cuda
    else:
        out["threads"] = threads  # trainer.num_threads
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="toy sizes of the same architectures, a tiny workload")
    p.add_argument("--models", default=None,
                   help=f"comma-separated, of: {', '.join(MODELS)} (default: all; --tiny: smollm2_135m)")
    p.add_argument("--algos", default="ppo,grpo")
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--dtypes", default=None,
                   help=f"comma-separated, of: {', '.join(PRECISIONS)} (default: fp32,bf16,fp16; --tiny: fp32,bf16)")
    p.add_argument("--rollouts", type=int, default=64, help="sequences per iteration")
    p.add_argument("--samples", type=int, default=4, help="GRPO: completions per prompt")
    p.add_argument("--prompt-len", type=int, default=128, help="max prompt tokens (min is half)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--minibatch", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--iterations", type=int, default=2, help="timed iterations")
    p.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    p.add_argument("--override", action="append", default=[],
                   help="an extra Hydra override for every row, e.g. generation=hf_generate (repeatable)")
    p.add_argument("--out", default=None, help="also write the JSON here, after every row")
    return p


TINY_WORKLOAD = dict(rollouts=4, samples=2, prompt_len=8, new_tokens=8, minibatch=2, warmup=0, iterations=1)


def main(argv=None):
    a = parser().parse_args(argv)
    if a.tiny:
        for k, v in TINY_WORKLOAD.items():
            setattr(a, k, v)
    a.models = a.models or ("smollm2_135m" if a.tiny else ",".join(MODELS))
    a.dtypes = a.dtypes or ("fp32,bf16" if a.tiny else "fp32,bf16,fp16")
    device = torch.device("cuda" if a.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no GPU here (use --device cpu --tiny for the smoke run)")
    settings = {k: getattr(a, k) for k in ("tiny", "rollouts", "samples", "prompt_len", "new_tokens", "epochs",
                                           "minibatch", "warmup", "iterations", "override")}
    result = {"machine": machine(device, a.threads), "settings": {**settings, "lora": "r=16, alpha=32, all-linear",
                                                       "reward_model": REWARD_MODEL}, "rows": []}
    for model in a.models.split(","):
        for algo in a.algos.split(","):
            for mode in a.modes.split(","):
                for dtype in a.dtypes.split(","):
                    row = {"model": model, "algorithm": algo, "mode": mode, "dtype": dtype}
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    t = time.perf_counter()
                    try:
                        row.update(measure(a, model, algo, mode == "lora", dtype, device))
                    except Exception as err:  # a combination the product cannot run today: say so, go on
                        row["error"] = f"{type(err).__name__}: {err}"[:600]
                        frames = traceback.extract_tb(err.__traceback__)[-4:]  # where: the innermost frames
                        row["error_where"] = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]
                        traceback.print_exc()
                    row["wall_s"] = round(time.perf_counter() - t, 1)
                    result["rows"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)  # progress
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    if a.out:
                        Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
