"""Generated tokens per second of the generation backends (``generation=decode_loop`` / ``hf_generate`` /
``static_cache``, the last with and without ``torch.compile``) on one device, in one process: the same
random model and prompts for each, one backend after the other, medians. Prints one JSON object
(``--out FILE`` also writes it there after each backend's warm-up and at the end).

    python benchmarks/generation.py --device cuda --dtype bfloat16            # SmolLM2-135M's shape on a GPU
    python benchmarks/generation.py --device cpu --dtype float32 --model tiny --prompts 4 --num-samples 2 \
        --new-tokens 16 --rounds 2                                            # a CPU smoke run of the same code

The model is a ``LlamaForCausalLM`` with random weights built from SmolLM2-135M's config hyper-parameters
(30 layers, width 576, 9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied head; ``--model tiny``: 2
layers, width 64) in ``--dtype``. ``--prompts`` prompts of ``--prompt-len // 2`` to ``--prompt-len``
random tokens, left-padded, ``--num-samples`` samples each (rows ``prompts × num_samples``), ``--new-tokens``
new tokens sampled at temperature 1 with each token's log-prob recorded (``with_scores``; no EOS, so every
row runs to the end and the token count is exact). Each backend's first call is its warm-up (for
``static_cache`` with compile: ``torch.compile`` and the CUDA-graph capture; ``warmup_s``), then
``--rounds`` timed calls (CUDA synchronised around each); backends run one after the other (not
interleaved: meant for a GPU of one's own), so each row is written as soon as it is measured. ``greedy_match``: the fraction of
greedy tokens (all, the first 16 steps, whole rows) each backend shares with the decode loop's on the same
prompts (in bf16, kernels that add in another order may flip a near-tie, after which a row's tokens differ).
"""
from __future__ import annotations

from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402  (before torch is imported)

set_cpu_defaults()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

# SmolLM2-135M's config.json hyper-parameters (HuggingFaceTB/SmolLM2-135M), built with random weights
SHAPES = {
    "smollm2_135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu"),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True),
}
BACKENDS = ("decode_loop", "static_cache", "hf_generate", "static_cache_eager")


def settings_of(backend):
    """The object holding a backend's rollout settings (``do_sample``, ...): the ``HFGenerateBackend`` inside."""
    while hasattr(backend, "fallback"):
        backend = backend.fallback
    return backend


def make_backend(name: str, lm, new_tokens: int):
    from rlhf_train.generation.decode_loop import DecodeLoopBackend
    from rlhf_train.generation.hf_generate import HFGenerateBackend
    from rlhf_train.generation.static_cache import StaticCacheBackend

    kw = dict(eos_token_id=-1, pad_token_id=0, max_new_tokens=new_tokens, do_sample=True, with_scores=True)
    if name == "decode_loop":
        return DecodeLoopBackend(lm, **kw)
    if name == "hf_generate":
        return HFGenerateBackend(lm, **kw)
    return StaticCacheBackend(lm, compile=name == "static_cache", **kw)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--model", default="smollm2_135m", choices=sorted(SHAPES))
    for flag, default in (("--prompts", 32), ("--num-samples", 4), ("--prompt-len", 64), ("--new-tokens", 128),
                          ("--rounds", 3)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(**SHAPES[a.model], pad_token_id=0, eos_token_id=1, bos_token_id=1))
    lm = lm.to(device=device, dtype=dtype).eval()
    g = torch.Generator().manual_seed(1)
    V, P = lm.config.vocab_size, a.prompt_len
    prompt = torch.randint(2, V, (a.prompts, P), generator=g)
    lengths = torch.randint(P // 2, P + 1, (a.prompts,), generator=g)
    mask = torch.arange(P)[None] >= (P - lengths)[:, None]         # left-padded
    prompt, mask = prompt.masked_fill(~mask, 0).to(device), mask.to(device)
    rows = a.prompts * a.num_samples
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "model": a.model,
              "dtype": a.dtype, "rows": rows, "prompts": a.prompts, "num_samples": a.num_samples,
              "prompt_len": P, "new_tokens": a.new_tokens, "rounds": a.rounds, "backends": {}}

    def dump():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    names = [n for n in a.backends.split(",") if n]
    reference_greedy = None
    for name in names:  # one backend at a time: warm-up (compile, graph capture), greedy check, timed rounds
        row = result["backends"][name] = {}
        try:
            backend = make_backend(name, lm, a.new_tokens)
            sync()
            t = time.perf_counter()
            gen = backend.generate(prompt, mask, a.num_samples)
            sync()
            row["warmup_s"] = round(time.perf_counter() - t, 2)
            assert gen.response.shape == gen.log_probs.shape == (rows, a.new_tokens), gen.response.shape
            settings_of(backend).do_sample = False  # greedy, same shapes (no new compile)
            tokens = backend.generate(prompt, mask, a.num_samples).response
            settings_of(backend).do_sample = True
            reference_greedy = tokens if reference_greedy is None else reference_greedy
            same = tokens == reference_greedy
            row["greedy_match"] = {"tokens": round(same.float().mean().item(), 4),
                                   "first_16_steps": round(same[:, :16].float().mean().item(), 4),
                                   "rows": round(same.all(1).float().mean().item(), 4)}
            times = []
            for _ in range(a.rounds):
                sync()
                t = time.perf_counter()
                backend.generate(prompt, mask, a.num_samples)
                sync()
                times.append(time.perf_counter() - t)
            s = statistics.median(times)
            row.update(generate_s=round(s, 4), tokens_per_s=round(rows * a.new_tokens / s),
                       all_s=[round(x, 4) for x in times])
        except Exception as err:  # keep the row, run the next backend
            row["error"] = f"{type(err).__name__}: {err}"[:500]
            traceback.print_exc()
        print(json.dumps({name: row}), flush=True)
        dump()
    base = result["backends"].get("decode_loop", {}).get("generate_s")
    for name, row in result["backends"].items():
        if base and "generate_s" in row:
            row["speedup_vs_decode_loop"] = round(base / row["generate_s"], 2)
    if device.type == "cuda":
        result["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    dump()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
