"""Layer 0, core: pure tensor math, no models, no configs, no I/O.

Functions of tensors in, tensors out, each with its shapes (``[B, T]``) and the paper and equation it
implements in the docstring: masked reductions (``masked``), advantage estimators such as GAE
(``advantages``), the clipped PPO policy / value losses (``losses``), KL estimators k1/k2/k3 (``kl``),
the sampler / trainer mismatch and its importance-sampling correction (``mismatch``), DAPO's soft overlong
punishment (``overlong``), sequence packing: first-fit-decreasing bins and the packed row's index maps
(``packing``), log-probs and entropy from logits (``logprob_kernel``), logits processing for sampling (``sampling``), held-out accuracy,
pass@k and mean@k of verifiable rewards (``eval_metrics``), and the typed
token containers ``Tokens`` / ``Masks`` / ``LogProbs`` / ``Rollout`` (``containers``).

May import: only ``rlhf_train.core`` itself, torch and tensordict; never transformers, hydra,
omegaconf or accelerate (``tests/meta/test_architecture.py`` checks this).

Extension point: a new advantage estimator is a pure function in ``rlhf_train/core/advantages.py``,
wrapped as an ``AdvantageEstimator`` (``rlhf_train/algorithms/base.py``) for the algorithms to use.
"""
