"""Where one iteration's passes, large tensors and memory go: the counts that do not depend on the machine's load.

Builds the same run as ``benchmarks/ppo_iteration.py`` (its flags; ``--shape smollm2`` for SmolLM2-135M's
shape with ``benchmarks/compare_trl.py``'s settings, ``benchmarks/shapes.py``), runs ``--warmup`` untimed
iterations, then one instrumented iteration of the loop's own ``step``, and prints one JSON line:

* ``passes``: forward passes per model (``policy``, ``reference``, ``reward``), split by what called them
  (``generate`` / ``policy_scoring`` / ``reference`` / ``reward`` / ``update``): ``prefill`` calls (more
  than one new position) and ``decode_steps`` (one position), with their batch × length shapes (a pass that
  shares its prompts, ``trainer.shared_prompt``, is two calls: ``U × P`` distinct prompts, then ``B × T``);
* ``large_tensors``: every new tensor an op of the step wrote (forward or backward, any phase) with at least
  ``--large-fraction`` × B·T·V elements (B rollouts, T response tokens, V vocabulary): its op, shape, MB
  and phase. ``bt_v_mb`` is the size of one ``[B, T, V]`` float32 tensor for comparison;
* ``update_passes`` (forward + backward passes of the update: one per micro-batch) and
  ``saved_for_backward_mb``: the bytes autograd keeps between one such pass's forward and backward (distinct
  storages, by ``torch.autograd.graph.saved_tensors_hooks``; the largest pass), and its five largest;
* ``static_mb``: parameters of each model, the policy's gradients and optimizer state;
* ``peak_rss_mb`` per phase and ``minor_faults`` per phase (fresh pages the kernel mapped and zeroed; a
  5 ms sampler thread reading ``/proc/self/statm`` and ``/proc/self/stat``), and the process's peak.

The dispatch-mode tracing slows the instrumented iteration down: this script gives no times (use
``ppo_iteration.py`` on a quiet machine for those).

    python benchmarks/iteration_profile.py --shape smollm2 --algorithm grpo
    python benchmarks/iteration_profile.py --shape smollm2 --algorithm ppo
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_iteration  # noqa: E402  (sets the CPU defaults before torch is imported)

import contextlib  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

class Phase:
    """The phase the process is in (a name, or ``other``), set by wrappers around each component."""

    name = "other"

    @classmethod
    @contextlib.contextmanager
    def of(cls, name: str):
        prev, cls.name = cls.name, name
        try:
            yield
        finally:
            cls.name = prev

    @classmethod
    def wrap(cls, fn, name: str):
        def wrapped(*args, **kwargs):
            with cls.of(name):
                return fn(*args, **kwargs)
        return wrapped


class LargeTensors(TorchDispatchMode):
    """Records every op output of at least ``threshold`` elements in memory of its own (not a view of an
    input, not an input written in place): op, shape, MB, phase."""

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold, self.seen = threshold, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if _strided(a)}  # strided tensors only: an opaque (MKL-DNN) one has no storage to read
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if (_strided(t) and t.numel() >= self.threshold and Phase.name != "other"
                    and t.untyped_storage().data_ptr() not in inputs):  # written memory, not a view or in place
                self.seen.append({"phase": Phase.name, "op": str(func.overloadpacket.__name__),
                                  "shape": list(t.shape), "mb": round(t.numel() * t.element_size() / 2**20, 1)})
        return out


def _strided(t) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_mkldnn


class RSSSampler(threading.Thread):
    """Peak RSS (MB) and minor page faults (each a fresh page mapped and zeroed) per phase, sampled every
    ``interval`` seconds."""

    def __init__(self, interval: float = 0.005):
        super().__init__(daemon=True)
        self.interval, self.stop = interval, threading.Event()
        self.peak, self.faults = defaultdict(float), defaultdict(int)
        self.page = os.sysconf("SC_PAGE_SIZE")

    def run(self):
        with open("/proc/self/statm") as statm, open("/proc/self/stat") as stat:
            last = None
            while not self.stop.is_set():
                statm.seek(0)
                stat.seek(0)
                rss = int(statm.read().split()[1]) * self.page / 2**20
                minflt = int(stat.read().rsplit(")", 1)[1].split()[7])  # field 10 of /proc/<pid>/stat
                phase = Phase.name
                self.peak[phase] = max(self.peak[phase], rss)
                if last is not None:
                    self.faults[phase] += minflt - last
                last = minflt
                time.sleep(self.interval)


def count_passes(modules: dict, counts: dict):
    """Forward pre-hooks on each trunk: ``counts[(model, phase, kind)] -> [shape, ...]``."""
    handles = []
    for name, module in modules.items():
        if module is None:
            continue

        def hook(mod, args, kwargs, name=name):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:
                ids = kwargs.get("inputs_embeds")
            shape = list(ids.shape[:2])
            kind = "decode_steps" if shape[1] == 1 else "prefill"
            counts[(name, Phase.name, kind)].append(shape)
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def trunk_of(model):
    from rlhf_train.models.scoring import lm_trunk_and_head

    if model is None:
        return None
    if hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        return lm_trunk_and_head(model)[0]
    inner = getattr(model, "model", None)  # an HF sequence classifier inside rlhf_train's reward-model wrapper
    if hasattr(inner, "base_model") and not hasattr(model, "base_model"):
        return inner.base_model
    return getattr(model, "base_model", None) or getattr(model, "trunk", model)


def mb(params) -> float:
    return round(sum(p.numel() * p.element_size() for p in params) / 2**20, 1)


def main(argv=None):
    p = ppo_iteration.parser()
    p.add_argument("--large-fraction", type=float, default=0.25,
                   help="record op outputs of at least this fraction of B·T·V elements")
    a = p.parse_args(argv)
    ppo_iteration.apply_shape(a)
    settings = dict(layers=a.layers, width=a.width, heads=a.heads, vocab=a.vocab, prompt_len=a.prompt_len,
                    new_tokens=a.new_tokens, rollouts=a.rollouts, epochs=a.epochs, minibatch=a.minibatch,
                    num_samples=a.num_samples, arch=a.arch, kv_heads=a.kv_heads, intermediate=a.intermediate)
    extra = ([f"algorithm.beta={a.grpo_beta}"] if a.grpo_beta is not None else []) + a.override
    sampler = RSSSampler()
    sampler.start()
    bench = ppo_iteration.RLHFTrainBenchmark(threads=a.threads, seed=a.seed, max_iterations=a.warmup + 1,
                                             algorithm=a.algorithm, extra=extra,
                                             reference_responses=not a.no_reference_responses, **settings)
    run = bench.run_
    for _ in range(a.warmup):
        with Phase.of("warmup"):
            bench.run()
    # the phases: wrap each component of the rollout and the update
    import rlhf_train.loop.trainer as trainer

    ro = run.rollout.inner
    policy = run.accelerator.unwrap_model(run.policy)
    backend_generate = ro.backend.generate
    ro.backend.generate = Phase.wrap(backend_generate, "generate")
    ro.policy_log_probs_and_values = Phase.wrap(ro.policy_log_probs_and_values, "policy_scoring")
    if ro.reference is not None:
        ro.reference.fn = Phase.wrap(ro.reference.fn, "reference")
    for name, (source, w) in list(ro.reward_sources.items()):
        ro.reward_sources[name] = (Phase.wrap(source, "reward"), w)
    update = trainer.minibatch_update
    trainer.minibatch_update = Phase.wrap(update, "update")
    trainer.step = Phase.wrap(trainer.step, "step")  # the rest of the loop's step (the benchmark's own work: other)
    counts = defaultdict(list)
    ref_model = ro.reference.model if ro.reference is not None else None
    handles = count_passes({"policy": trunk_of(policy.lm), "reference": trunk_of(ref_model),
                            "reward": trunk_of(run.reward_model)}, counts)
    # saved-for-backward bytes of each forward pass of the update (distinct storages; a pass starts at the
    # policy trunk's forward), the largest pass reported
    passes_saved: list[dict] = []

    def pack(t):
        if Phase.name == "update" and passes_saved:
            passes_saved[-1].setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage().nbytes(), list(t.shape)))
        return t

    def new_pass(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        continues = cache is not None and cache.get_seq_length() > 0  # a shared prompt's responses: the same pass
        if Phase.name == "update" and torch.is_grad_enabled() and not continues:
            passes_saved.append({})
    handles.append(trunk_of(policy.lm).register_forward_pre_hook(new_pass, with_kwargs=True))

    V, T, B = settings["vocab"], settings["new_tokens"], settings["rollouts"]
    tracer = LargeTensors(int(a.large_fraction * B * T * V))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracer:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        bench.run()
    for h in handles:
        h.remove()
    sampler.stop.set()
    sampler.join()
    passes = defaultdict(dict)
    for (model, phase, kind), shapes in sorted(counts.items()):
        entry = passes[model].setdefault(phase, {})
        entry[kind] = len(shapes)
        entry[f"{kind}_shapes"] = sorted({f"{s[0]}x{s[1]}" for s in shapes})
    opt_state = [t for s in run.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out = {
        "shape": a.shape, "algorithm": a.algorithm, **settings, "reference_responses": not a.no_reference_responses,
        "passes": passes,
        "bt_v_mb": round(B * T * V * 4 / 2**20, 1),
        "large_tensors": tracer.seen,
        "update_passes": len(passes_saved),
        "saved_for_backward_mb": round(max(sum(n for n, _ in p.values()) for p in passes_saved) / 2**20, 1)
        if passes_saved else 0.0,
        "saved_for_backward_largest": [{"shape": s, "mb": round(n / 2**20, 1)} for n, s in sorted(
            max(passes_saved, key=lambda p: sum(n for n, _ in p.values())).values(), key=lambda x: -x[0])[:5]]
        if passes_saved else [],
        "static_mb": {"policy": mb(policy.parameters()), "reference": mb(ref_model.parameters()) if ref_model is not None
                      and ref_model is not policy.lm else 0.0,
                      "reward": mb(run.reward_model.parameters()) if run.reward_model is not None else 0.0,
                      "gradients": mb([p for p in policy.parameters() if p.requires_grad]),
                      "optimizer_state": mb(opt_state)},
        "peak_rss_mb_by_phase": {k: round(v, 1) for k, v in sorted(sampler.peak.items())},
        "minor_faults_by_phase": dict(sorted(sampler.faults.items())),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_rss_mb_before_instrumented": round(before / 1024, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
