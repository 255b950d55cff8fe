"""The shapes and per-algorithm settings ``compare_trl.py`` measures both sides at, in one place
(``ppo_iteration.py --shape NAME`` and ``iteration_profile.py --shape NAME`` run rlhf_train's side of them).

Shapes: ``arch`` and the model's size, prompts of ``prompt_len/2 … prompt_len`` tokens, ``new_tokens`` per
response; every iteration 32 rollouts. Settings per algorithm: PPO 32 prompts, 3 epochs, minibatches of 16;
GRPO 8 prompts × 4 samples, 1 epoch (one optimizer step over the 32), a KL to a reference in the loss (β 0.04).
Both: a reward model of the policy's shape, no reference responses (TRL's trainers score none).
"""
from __future__ import annotations

SHAPES = {
    "gpt2_1": dict(arch="gpt2", layers=2, width=128, heads=4, vocab=50257, prompt_len=64, new_tokens=50),
    "gpt2_2": dict(arch="gpt2", layers=4, width=256, heads=4, vocab=50257, prompt_len=48, new_tokens=32),
    "smollm2": dict(arch="llama", layers=30, width=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152,
                    prompt_len=64, new_tokens=48),
}
ROLLOUTS = 32
ALGORITHMS = {
    "ppo": dict(epochs=3, minibatch=16, num_samples=1),
    "grpo": dict(epochs=1, minibatch=32, num_samples=4, beta=0.04),
}
