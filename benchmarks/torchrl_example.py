"""Baseline: one PPO iteration of torchrl's ``examples/rlhf/train_rlhf.py`` ("the torchrl-example way").

This reproduces, piece by piece and with torchrl's own library parts, what one outer
iteration (``for _ in range(max_epochs)``) of the torchrl RLHF example does, so that our
trainer can be compared against it (see ``benchmarks/compare_torchrl.py``).  Mapping to the
example (``examples/rlhf/{train_rlhf.py,utils.py,models/*.py,config/train_rlhf.yaml}``):

* prompts        ``get_prompt_loaders`` -> ``PromptData`` batches of TL;DR ``prompt + label``
                 (right padded to ``block_size`` with 50256, ``prompt_rindex`` as written by
                 ``PromptTensorDictTokenizer``).  Here: synthetic ``PromptData`` batches.
* policy         ``init_actor_critic``: ``LMHeadActorValueOperator(GPT2LMHeadModel)``, then
                 ``.eval()``; actor = ``get_policy_operator()``, critic =
                 ``VmapModule(get_value_operator())``, critic head = ``get_value_head()``.
* ref model      ``make_ref_model``: ``deepcopy(model).requires_grad_(False)``.
* layer freezing ``freeze_layers``: freezes ``layers[:-int(0.3 * n_layers)]``.
* reward model   ``make_reward_model``: ``TensorDictModule(GPT2RewardModel, ...)``, eval, frozen.
* loss           ``make_loss``: ``GAE(critic, gamma=0.99, lmbda=0.95, average_gae=True,
                 shifted=True)`` and ``ClipPPOLoss(actor, critic_head)``.
* optimizer      ``make_optimizer``: ``AdamW(lr=5e-5, weight_decay=0, betas=(0.9, 0.999))``
                 + ``CosineAnnealingLR(T_max=3000, eta_min=5e-6)``.
* replay buffer  ``make_replay_buffer``: ``TensorDictReplayBuffer(LazyTensorStorage(
                 episode_length * num_rollouts), batch_size=episode_length * batch_size,
                 SamplerWithoutReplacement(), prefetch=10)``; ``make_sub_replay_buffer``
                 per outer batch: ``TensorStorage`` + ``SamplerWithoutReplacement`` with
                 ``batch_size=ppo_batch_size`` (16 timesteps).
* collector      ``RolloutFromModel(model, ref_model, reward_model,
                 kl_scheduler=AdaptiveKLController(0.1, 6, 10000), num_steps=collection_iters)``.
* one iteration  ``rb.empty()``; ``collection_iters`` x (``rollout_from_data`` -> ``advantage(td)``
                 -> ``rb.extend(flatten_td(td))`` -> stats); ``step_scheduler()``; then
                 ``for batch in rb``: sub-buffer, ``ppo_num_epochs`` x (``zero_grad``; for each
                 16-timestep minibatch: loss, ``backward``, ``clip_grad_norm_(1.0)``;
                 ``optimizer.step()``; ``lr_scheduler.step()``).

Left out on purpose (not part of the PPO iteration being timed): the wandb/file loggers,
the periodic ``Evaluator`` (every ``eval_interval=6`` outer rb batches it does 10 extra
validation rollouts + a test-prompt generation) and checkpoint saving.  The example's
CUDA-only pieces (bf16 autocast, ref model on ``cuda:1``) do not apply on CPU: ``setup``
returns a ``nullcontext`` when the device is not CUDA, so everything runs in fp32 here,
as the example does on CPU.  ``compile`` is ``False`` in the example's config.

Workarounds needed to run the example with transformers 5 (each is also marked ``WORKAROUND``
in the code):

1. The example builds the policy with ``GPT2LMHeadModel.from_pretrained(..., return_dict=False)``
   so that ``LMHeadActorValueOperator``'s ``TensorDictModule(base_model.transformer,
   out_keys=["x", "_"])`` receives a ``(hidden_states, past_key_values)`` tuple.  With
   transformers 5, ``config.return_dict=False`` breaks ``GPT2LMHeadModel.forward`` itself
   (it reads ``transformer_outputs.last_hidden_state`` off a tuple), which is used by
   ``RolloutFromModel`` (``generate``/``_log_ratio``).  So the model keeps the default
   ``return_dict=True`` and only the actor-critic's transformer call gets
   ``return_dict=False`` (via that ``TensorDictModule``'s ``method_kwargs``), which is exactly
   what the example's config achieved for that call.
2. ``GPT2RewardModel(model_path=None)`` builds a full-size GPT-2 (124M params) before we could
   swap it; instead the instance is created with ``__new__`` and given the four attributes its
   ``__init__`` sets (``config``, ``transformer``, a 1-output ``lm_head``, ``pad_id``) from a
   small GPT-2 of the benchmark's shape -- same class, same ``forward``/``_compute_end_scores``.
   (No hub: everything is built from a ``GPT2Config``.)
3. The critic is ``VmapModule(value_operator)``: ``torch.vmap`` over the time dim of the
   ``[B, T, L]`` per-timestep prefixes.  transformers 5's SDPA mask builder
   (``masking_utils._ignore_causal_mask_sdpa``) branches on tensor values, which ``vmap``
   rejects.  The GPT-2 of the example's era only had eager attention, whose mask builder has
   no such branch, so the models are built with ``attn_implementation="eager"`` (default of
   ``attn``); ``attn="sdpa"`` is offered for comparison and then uses torchrl's own fallback
   ``VmapModule(..., mock=True)`` (same values, one call per timestep instead of one batched
   call).
4. torchrl >= 0.10's ``ClipPPOLoss`` reads the behaviour log-prob from ``"action_log_prob"``
   by default; ``RolloutFromModel`` still writes ``"sample_log_prob"`` (the example's key), so
   ``loss_fn.set_keys(sample_log_prob="sample_log_prob")``.
5. ``RolloutFromModel`` stores ``sample_log_prob`` as ``[B, T, 1]`` while the Categorical
   actor's log-prob is per-sample (``[N]``); in ``ClipPPOLoss`` that silently broadcasts to a
   ``[16, 16, 1]`` log-ratio.  It is squeezed to ``[B, T]`` right after each rollout (the
   compute is unchanged; the ratio is then per-timestep as intended).

Kept as in the example although questionable (they do not change the amount of work):
``sample_log_prob`` comes from ``generate``'s *processed* scores, i.e. after HF's default
``top_k=50`` warper, so the first PPO ratio is ~exp(-ln(V/50)) (clip fraction ~1); and with
2 layers ``freeze_layers`` freezes nothing.
"""

from __future__ import annotations

import os

# the CPU defaults of `python -m rlhf_train` (why: rlhf_train/infra/cpu_defaults.py), set before torch is imported
from rlhf_train.infra.cpu_defaults import set_cpu_defaults  # noqa: E402

set_cpu_defaults()

import argparse
import json
import resource
import time
from copy import deepcopy

import torch
from tensordict.nn import TensorDictModule
from torch import nn

RLHF_EOS = 50256  # GPT-2 EOS == pad token used throughout torchrl's rlhf/llm utilities


# --------------------------------------------------------------------------------------
# helpers copied in spirit from examples/rlhf/utils.py
# --------------------------------------------------------------------------------------
def flatten_td(td):
    """examples/rlhf/utils.py::flatten_td: keep timesteps up to (and incl.) the first done."""
    done = td["next", "done"]
    mask = torch.zeros_like(done)
    mask[..., 1:, :] = done[..., :-1, :]  # shift by one
    mask = ~mask.cumsum(-2).bool().squeeze()
    return td[mask]


def make_sub_replay_buffer(data, batch_size):
    """examples/rlhf/utils.py::make_sub_replay_buffer (a zero-copy sub-replay buffer)."""
    from torchrl.data import TensorDictReplayBuffer, TensorStorage
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    storage = TensorStorage(data.exclude("index"))
    return TensorDictReplayBuffer(
        storage=storage, batch_size=batch_size, sampler=SamplerWithoutReplacement()
    )


def _gpt2_config(layers, width, heads, vocab, n_positions, dropout, attn_implementation):
    from transformers import GPT2Config

    # examples/rlhf/models/transformer.py::init_transformer passes these dropout kwargs.
    # WORKAROUND (3): ``attn_implementation`` ("eager" by default), see the module docstring.
    return GPT2Config(
        attn_implementation=attn_implementation,
        n_layer=layers,
        n_embd=width,
        n_head=heads,
        vocab_size=vocab,
        n_positions=n_positions,
        bos_token_id=RLHF_EOS,
        eos_token_id=RLHF_EOS,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        summary_first_dropout=dropout,
    )


def make_tiny_reward_model(config):
    """A ``torchrl.modules.models.llm.GPT2RewardModel`` around a small GPT-2.

    WORKAROUND (2): ``GPT2RewardModel(model_path=None)`` instantiates a default-size GPT-2
    (124M params, ~0.5 GB) that we would immediately throw away -- and that would inflate the
    peak RSS we report.  We therefore create the instance without calling its ``__init__`` and
    set exactly the attributes that ``__init__`` sets, from a small ``GPT2LMHeadModel``.
    """
    from torchrl.modules.models.llm import GPT2RewardModel
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(config)
    rm = GPT2RewardModel.__new__(GPT2RewardModel)
    nn.Module.__init__(rm)
    rm.config = model.config
    rm.transformer = model.transformer
    # replace last layer with the reward layer (as in GPT2RewardModel.__init__)
    rm.lm_head = nn.Linear(rm.config.n_embd, 1, bias=False)
    rm.pad_id = RLHF_EOS  # == GPT2RewardModel(pad_token_id=50256)
    return rm


def make_prompt_batches(n_batches, batch, prompt_len, label_len, vocab, generator):
    """Synthetic TL;DR-like ``PromptData`` batches.

    Each row is ``prompt + label`` (the label plays the TL;DR reference summary), right padded
    with 50256 to ``block_size = prompt_len + label_len`` (TL;DR: ``max_length`` padding to the
    block size of 550).  Prompt lengths are random in ``[prompt_len // 2, prompt_len]``, label
    lengths random in ``[max(1, label_len // 2), label_len]``.  As in
    ``PromptTensorDictTokenizer``, ``prompt_rindex = len(prompt_tokens) - 1`` and
    ``labels = input_ids`` (``PromptData.from_dataset``).
    """
    from torchrl.data.llm.prompt import PromptData

    block_size = prompt_len + label_len
    hi = RLHF_EOS  # random ids in [0, 50256): never the EOS/pad id
    out = []
    for _ in range(n_batches):
        input_ids = torch.full((batch, block_size), RLHF_EOS, dtype=torch.int64)
        attention_mask = torch.zeros((batch, block_size), dtype=torch.int64)
        rindex = torch.empty(batch, dtype=torch.int64)
        for i in range(batch):
            p = int(torch.randint(prompt_len // 2, prompt_len + 1, (), generator=generator))
            lab = int(
                torch.randint(max(1, label_len // 2), label_len + 1, (), generator=generator)
            )
            n = p + lab
            input_ids[i, :n] = torch.randint(0, hi, (n,), generator=generator)
            attention_mask[i, :n] = 1
            rindex[i] = p - 1
        out.append(
            PromptData(
                input_ids=input_ids,
                attention_mask=attention_mask,
                prompt_rindex=rindex,
                labels=input_ids.clone(),
                batch_size=[batch],
            )
        )
    return out


def _tdm_of_transformer(a2c):
    # ActorValueOperator.module = [common, actor_head, value_head]; common is
    # TensorDictSequential(TensorDictModule(base_model.transformer, out_keys=["x", "_"]),
    #                      TensorDictModule(lambda x: x[:, -1, :]))
    common = a2c.module[0]
    tdm = common.module[0]
    assert isinstance(tdm, TensorDictModule) and tdm.out_keys[0] == "x"
    return tdm


# --------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------
def run_torchrl_example_iteration(
    *,
    layers: int = 2,
    width: int = 128,
    heads: int = 4,
    vocab: int = 50257,
    prompt_len: int = 64,
    batch: int = 4,
    new_tokens: int = 50,
    rollouts: int = 32,
    epochs: int = 3,
    minibatch: int = 16,
    threads: int = 2,
    seed: int = 0,
    label_len: int | None = None,
    attn: str = "eager",
    return_details: bool = False,
) -> dict:
    """Run one PPO iteration the way torchrl's ``examples/rlhf/train_rlhf.py`` does.

    ``label_len`` (default ``new_tokens``) is the maximal length of the reference "summary"
    that follows each prompt in the ``PromptData`` block.  ``attn`` is the GPT-2 attention
    implementation (``"eager"``: see WORKAROUND (3); ``"sdpa"`` switches the critic's
    ``VmapModule`` to ``mock=True``).  ``return_details=True`` adds a
    ``"details"`` entry with sanity checks (losses, parameter change, shapes).
    """
    from torch.optim.lr_scheduler import CosineAnnealingLR
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data.llm.utils import AdaptiveKLController, RolloutFromModel
    from torchrl.data.replay_buffers import SamplerWithoutReplacement
    from torchrl.modules import LMHeadActorValueOperator, VmapModule
    from torchrl.objectives import ClipPPOLoss
    from torchrl.objectives.value import GAE
    from transformers import GPT2LMHeadModel

    if vocab <= RLHF_EOS:
        raise ValueError(
            f"vocab={vocab}: torchrl's RolloutFromModel/PromptData hard-code the GPT-2 EOS/pad "
            f"id {RLHF_EOS}, so the vocabulary must contain it (vocab >= {RLHF_EOS + 1})."
        )
    if prompt_len < 2:
        raise ValueError("prompt_len must be >= 2")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)  # example: utils.setup -> torch.manual_seed(1337)
    if label_len is None:
        label_len = new_tokens

    # ---- config (examples/rlhf/config/train_rlhf.yaml) ----
    batch_size = batch  # data.batch_size: 4
    episode_length = new_tokens  # train.ppo.episode_length: 50
    num_rollouts_per_epoch = rollouts  # train.ppo.num_rollouts_per_epoch: 32
    ppo_batch_size = minibatch  # train.ppo.ppo_batch_size: 16
    ppo_num_epochs = epochs  # train.ppo.ppo_num_epochs: 3
    collection_iters = num_rollouts_per_epoch // batch_size
    grad_clip = 1.0
    dropout = 0.1  # model.dropout (inactive: the example puts the model in eval())
    block_size = prompt_len + label_len
    n_positions = max(1024, block_size + episode_length)

    # ---- data ----
    gen = torch.Generator().manual_seed(seed)
    prompt_batches = make_prompt_batches(
        collection_iters, batch_size, prompt_len, label_len, vocab, gen
    )
    train_prompt_loader = iter(prompt_batches)

    # ---- models (models/actor_critic.py::init_actor_critic) ----
    config = _gpt2_config(layers, width, heads, vocab, n_positions, dropout, attn)
    # WORKAROUND (1): keep return_dict=True on the HF model (transformers 5 breaks
    # GPT2LMHeadModel.forward with return_dict=False); see _tdm_of_transformer below.
    model = GPT2LMHeadModel(config)
    a2c = LMHeadActorValueOperator(model)
    # WORKAROUND (1, cont.): the example relied on ``return_dict=False`` so that
    # ``base_model.transformer`` returns a ``(hidden_states, past_key_values)`` tuple for
    # ``out_keys=["x", "_"]``; pass it per call to that one TensorDictModule instead.
    _tdm_of_transformer(a2c).method_kwargs = {"return_dict": False}
    a2c.eval()
    actor = a2c.get_policy_operator()
    # WORKAROUND (3): with attn="sdpa" transformers 5 cannot run under torch.vmap, so fall back
    # to VmapModule's own mock mode (a Python loop over the time dim).
    critic = VmapModule(a2c.get_value_operator(), mock=(attn != "eager"))
    critic_head = a2c.get_value_head()

    # utils.make_ref_model
    ref_model = deepcopy(model)
    ref_model.requires_grad_(False)
    # utils.freeze_layers (note: with 2 layers int(0.3 * 2) == 0 -> layers[:-0] == [] so
    # nothing is frozen, exactly as the example would do)
    hlayers = model.transformer.h
    num_unfrozen = int(0.3 * len(hlayers))
    for layer in hlayers[:-num_unfrozen]:
        layer.requires_grad_(False)

    # utils.make_reward_model / models/reward.py::init_reward_model
    reward_model = TensorDictModule(
        make_tiny_reward_model(
            _gpt2_config(layers, width, heads, vocab, n_positions, dropout, attn)
        ),
        in_keys=["input_ids", "attention_mask"],
        out_keys=["rewards", "end_scores"],
    )
    reward_model.eval()
    reward_model.requires_grad_(False)

    # ---- loss / optimizer (utils.make_loss, utils.make_optimizer) ----
    advantage = GAE(
        value_network=critic, gamma=0.99, lmbda=0.95, average_gae=True, shifted=True
    )
    loss_fn = ClipPPOLoss(actor, critic_head)
    # WORKAROUND (4): RolloutFromModel stores the behaviour log-prob under "sample_log_prob";
    # torchrl >= 0.10 ClipPPOLoss looks for "action_log_prob" by default.
    loss_fn.set_keys(sample_log_prob="sample_log_prob")
    optimizer = torch.optim.AdamW(
        [p for p in loss_fn.parameters() if p.requires_grad],
        lr=5.0e-5,
        weight_decay=0.0,
        betas=(0.9, 0.999),
    )
    lr_scheduler = CosineAnnealingLR(optimizer, T_max=3000, eta_min=5.0e-6)

    # ---- replay buffer (utils.make_replay_buffer) ----
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(episode_length * num_rollouts_per_epoch),
        batch_size=episode_length * batch_size,
        sampler=SamplerWithoutReplacement(),
        prefetch=10,
    )

    # ---- collector ----
    kl_scheduler = AdaptiveKLController(init_kl_coef=0.1, target=6, horizon=10000)
    rollout_from_model = RolloutFromModel(
        model,
        ref_model,
        reward_model,
        max_new_tokens=episode_length,
        kl_scheduler=kl_scheduler,
        num_steps=collection_iters,
    )

    # time the HF generate calls made by RolloutFromModel.generate
    gen_time = [0.0]
    _orig_generate = model.generate

    def _timed_generate(*args, **kwargs):
        t = time.perf_counter()
        try:
            return _orig_generate(*args, **kwargs)
        finally:
            gen_time[0] += time.perf_counter() - t

    model.generate = _timed_generate

    params_before = {
        n: p.detach().clone() for n, p in loss_fn.named_parameters() if p.requires_grad
    }

    # ================= one iteration of the training loop ================= #
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    # ----------------- 1. Collect data, fill replay buffer ----------------- #
    rb.empty()
    gen_tokens = 0
    stats = {"next_reward": [], "next_kl": []}
    first_td_shapes = None
    for _ in range(collection_iters):
        pbatch = next(train_prompt_loader)
        td = rollout_from_model.rollout_from_data(pbatch)
        # WORKAROUND (5): RolloutFromModel writes "sample_log_prob" as [B, T, 1] while the
        # Categorical actor's log-prob is [B, T]; inside ClipPPOLoss that broadcasts
        # (log_prob[16] - prev[16, 1] -> log-ratio [16, 16, 1]).  Store it as [B, T].
        td.set("sample_log_prob", td.get("sample_log_prob").squeeze(-1))
        with torch.no_grad():  # ctx is nullcontext on CPU
            advantage(td)
        flat = flatten_td(td)
        rb.extend(flat)
        gen_tokens += flat.numel()
        # TrainLogger.__call__
        done = td.get(("next", "done"))
        td_done = td[done.view(td.shape)]
        stats["next_reward"].append(td_done.get(("next", "reward_raw")).mean().item())
        stats["next_kl"].append(td_done.get(("next", "reward_kl")).mean().item())
        if first_td_shapes is None:
            first_td_shapes = {
                "td_batch": list(td.batch_size),
                "input_ids": list(td["input_ids"].shape),
                "advantage": list(td["advantage"].shape),
            }
    kl_coef_before = rollout_from_model.kl_coef
    rollout_from_model.step_scheduler()
    t1 = time.perf_counter()

    # ----------------- 2. Feed model ----------------- #
    losses = []
    n_outer = 0
    n_minibatches = 0
    n_opt_steps = 0
    for rbatch in rb:
        n_outer += 1
        rb_ppo = make_sub_replay_buffer(rbatch, batch_size=ppo_batch_size)
        for _ in range(ppo_num_epochs):  # PPO epochs
            optimizer.zero_grad()
            for mbatch in rb_ppo:  # GO over RB
                loss_vals = loss_fn(mbatch)
                loss_val = sum(
                    value for key, value in loss_vals.items() if key.startswith("loss")
                )
                loss_val.backward()
                torch.nn.utils.clip_grad_norm_(loss_fn.parameters(), grad_clip)
                losses.append(loss_val.detach().item())
                n_minibatches += 1
            optimizer.step()
            lr_scheduler.step()
            n_opt_steps += 1
    t2 = time.perf_counter()
    ru2 = resource.getrusage(resource.RUSAGE_SELF)

    model.generate = _orig_generate  # drop the instance attribute again
    rollout_s = t1 - t0
    update_s = t2 - t1
    total_s = t2 - t0
    result = {
        "impl": "torchrl_example",
        "rollout_s": round(rollout_s, 3),
        "generate_s": round(gen_time[0], 3),
        "update_s": round(update_s, 3),
        "total_s": round(total_s, 3),
        "gen_tokens": int(gen_tokens),
        "tokens_per_s": round(gen_tokens / total_s, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        # process CPU time (user + sys) over the iteration: a contention-independent check
        "cpu_s": round(
            (ru2.ru_utime - ru0.ru_utime) + (ru2.ru_stime - ru0.ru_stime), 3
        ),
    }
    if return_details:
        with torch.no_grad():
            max_abs_change = max(
                (p.detach() - params_before[n]).abs().max().item()
                for n, p in loss_fn.named_parameters()
                if n in params_before
            )
            n_changed = sum(
                int(not torch.equal(p.detach(), params_before[n]))
                for n, p in loss_fn.named_parameters()
                if n in params_before
            )
        result["details"] = {
            **(first_td_shapes or {}),
            "rb_len": len(rb),
            "outer_batches": n_outer,
            "minibatches": n_minibatches,
            "optimizer_steps": n_opt_steps,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            "losses_finite": bool(losses) and all(map(lambda v: v == v and abs(v) != float("inf"), losses)),
            "params_trainable": len(params_before),
            "params_changed": n_changed,
            "max_abs_param_change": max_abs_change,
            "kl_coef": [float(kl_coef_before), float(rollout_from_model.kl_coef)],
            "rollout_reward_raw": sum(stats["next_reward"]) / len(stats["next_reward"]),
            "rollout_reward_kl": sum(stats["next_kl"]) / len(stats["next_kl"]),
        }
    return result


def main(argv=None):
    # torchrl's console logger writes INFO lines to stdout by default; keep stdout for the
    # single JSON result line (must be set before torchrl is first imported).
    os.environ.setdefault("TORCHRL_CONSOLE_STREAM", "stderr")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=50)
    p.add_argument("--rollouts", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--minibatch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--label-len",
        type=int,
        default=None,
        help="max length of the reference continuation in each prompt block (default: --new-tokens)",
    )
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    p.add_argument("--details", action="store_true", help="add sanity-check details")
    a = p.parse_args(argv)
    res = run_torchrl_example_iteration(
        layers=a.layers,
        width=a.width,
        heads=a.heads,
        vocab=a.vocab,
        prompt_len=a.prompt_len,
        batch=a.batch,
        new_tokens=a.new_tokens,
        rollouts=a.rollouts,
        epochs=a.epochs,
        minibatch=a.minibatch,
        threads=a.threads,
        seed=a.seed,
        label_len=a.label_len,
        attn=a.attn,
        return_details=a.details,
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
