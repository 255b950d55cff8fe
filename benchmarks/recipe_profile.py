"""Where a whole recipe run's time and memory go, phase by phase: ``python -m rlhf_train +recipe=NAME`` run in
this process (``rlhf_train.pipeline.run.run`` for a pipeline, ``rlhf_train.loop.trainer.train`` for ``stage=rl``)
with every phase wrapped: the GGUF conversion, building the run (models, LoRA, optimizer), the first RL iteration
apart from the others, the checkpoint and the export of the trained policy, the before / after evaluation; and in
the iterations and the evaluations their parts: the generation, the policy's scoring pass, the scoring (the reward
sources, overlapped with the reference pass) and the reference pass in it, the update.
Prints one JSON line:

* ``phases``: for each phase its wall seconds (summed over its calls; a phase's time includes its sub-phases'),
  its calls and the peak RSS (MB) seen while it ran outside its sub-phases (a 5 ms sampler thread reading
  ``/proc/self/statm``: ``benchmarks/iteration_profile.py``'s);
  ``iteration_1/generate`` is the first iteration's generation, ``iterations_2+/...`` the others' together,
  ``evaluate_after/reference`` the after-evaluation's reference passes;
* ``peak_rss_mb``: the process's peak (``getrusage``), and ``phase_of_peak``;
* ``large_tensors`` (``--large-tensors``): in the first iteration, every op output of at least a quarter of
  ``[B, T, V]`` float32 elements (B rollouts, T ``rollout.max_new_tokens``, V the vocabulary): its op, shape, MB
  and phase; ``bt_v_mb`` is one such tensor's size. The tracing slows that iteration down;
* ``load_before`` / ``load_after``: ``os.getloadavg()``, the machine's load (the times are only as good as it).

``--fresh-cache`` runs against an empty ``RLHF_TRAIN_CACHE`` (a temp dir, removed after), so the conversion
and every stage run; the default reuses the cache, where a finished stage is read back, not profiled.

    python benchmarks/recipe_profile.py --recipe arithmetic_grpo --fresh-cache
    python benchmarks/recipe_profile.py --recipe arithmetic_grpo --fresh-cache trainer.num_iterations=2
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import iteration_profile  # noqa: E402  (sets the CPU defaults before torch is imported)

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

Phase, RSSSampler = iteration_profile.Phase, iteration_profile.RSSSampler
WALL: dict = defaultdict(float)
CALLS: dict = defaultdict(int)


def timed(fn, name):
    """``fn`` run as phase ``name`` (a callable: the name at call time), its wall time added to :data:`WALL`."""
    def wrapped(*args, **kwargs):
        label = name() if callable(name) else name
        t = time.perf_counter()
        with Phase.of(label):
            try:
                return fn(*args, **kwargs)
            finally:
                WALL[label] += time.perf_counter() - t
                CALLS[label] += 1
    return wrapped


class Iteration:
    """The iteration the loop is in: ``iteration_1`` for the first, ``iterations_2+`` after it."""

    count = 0

    @classmethod
    def prefix(cls) -> str:
        return "iteration_1" if cls.count <= 1 else "iterations_2+"


def sub(name: str):
    """A sub-phase's label: ``<the top-level phase it runs in>/name``."""
    return lambda: f"{Phase.name.split('/')[0]}/{name}"


def install(tracer_box: dict) -> None:
    """Wrappers, at class or module level so that the training's and the evaluation's objects are both covered:
    conversion, build, each step (the first apart), the generation backends, the policy's scoring pass, the
    scoring (reward sources overlapped with the reference pass) and the reference pass in it, the update, the
    checkpoint, the export and each evaluation."""
    import rlhf_train.generation.decode_loop as decode_loop
    import rlhf_train.generation.hf_generate as hf_generate
    import rlhf_train.generation.static_cache as static_cache
    import rlhf_train.loop.trainer as trainer
    import rlhf_train.models.gguf as gguf
    import rlhf_train.pipeline.evaluate as evaluate
    from rlhf_train.models.reference import Reference
    from rlhf_train.rollout.rollout_from_model import RolloutFromModel

    gguf._convert = timed(gguf._convert, "convert_gguf")
    trainer.build_run = timed(trainer.build_run, "build_run")
    for module in (decode_loop, static_cache, hf_generate):
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__ and "generate" in vars(cls):
                cls.generate = timed(cls.generate, sub("generate"))
    RolloutFromModel.policy_log_probs_and_values = timed(RolloutFromModel.policy_log_probs_and_values,
                                                         sub("policy_scoring"))
    RolloutFromModel.score = timed(RolloutFromModel.score, sub("score"))
    Reference.log_probs = timed(Reference.log_probs, sub("reference"))
    trainer.minibatch_update = timed(trainer.minibatch_update, sub("update"))
    trainer.save_checkpoint = timed(trainer.save_checkpoint, "checkpoint")
    trainer.export_policy = timed(trainer.export_policy, "export_policy")
    step = trainer.step

    def counted_step(*args, **kwargs):
        Iteration.count += 1
        tracer = tracer_box.get("tracer") if Iteration.count == 1 else None
        if tracer is None:
            return timed(step, Iteration.prefix)(*args, **kwargs)
        with tracer:
            return timed(step, Iteration.prefix)(*args, **kwargs)
    trainer.step = counted_step
    before_after = iter(("evaluate_before", "evaluate_after"))
    evaluate.evaluate_policy = timed(evaluate.evaluate_policy, lambda: next(before_after, "evaluate"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="arithmetic_grpo", help="conf/recipe/NAME.yaml")
    p.add_argument("--fresh-cache", action="store_true", help="an empty RLHF_TRAIN_CACHE (temp dir, removed after)")
    p.add_argument("--large-tensors", action="store_true", help="trace the first iteration's large op outputs")
    p.add_argument("--run-dir", default=None, help="keep the run's outputs here (default: a temp dir, removed)")
    p.add_argument("--vocab", type=int, default=49152, help="the policy's vocabulary (SmolLM2's), for [B, T, V]")
    p.add_argument("overrides", nargs="*", help="key=value overrides after the recipe")
    a = p.parse_args(argv)
    cache = tempfile.mkdtemp(prefix="recipe_profile-") if a.fresh_cache else None
    if cache:
        os.environ["RLHF_TRAIN_CACHE"] = cache
    run_dir = Path(a.run_dir) if a.run_dir else Path(tempfile.mkdtemp(prefix="recipe_profile-run-"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.config import compose

    cfg = compose([f"+recipe={a.recipe}", "logger=none", "trainer.progress_bar=false", *a.overrides])
    load_before = os.getloadavg()
    box: dict = {}
    if a.large_tensors:
        B = cfg.data.batch_size * cfg.rollout.num_samples
        box["tracer"] = iteration_profile.LargeTensors(int(0.25 * B * cfg.rollout.max_new_tokens * a.vocab))
    install(box)
    sampler = RSSSampler()
    sampler.start()
    t0 = time.perf_counter()
    try:
        if cfg.stage == "rl":
            from rlhf_train.loop.trainer import train

            train(cfg, run_dir)
        else:
            from rlhf_train.pipeline.run import run

            run(cfg, run_dir)
    finally:
        sampler.stop.set()
        sampler.join()
        if not a.run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
    peaks = dict(sampler.peak)
    phases = {k: {"wall_s": round(WALL[k], 2), "calls": CALLS[k], "peak_rss_mb": round(peaks.get(k, 0.0), 1)}
              for k in sorted(set(WALL) | set(peaks))}
    out = {"recipe": a.recipe, "overrides": a.overrides, "fresh_cache": a.fresh_cache,
           "wall_s": round(time.perf_counter() - t0, 1), "phases": phases,
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "phase_of_peak": max(peaks, key=peaks.get) if peaks else None,
           "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()]}
    if "tracer" in box:
        out["bt_v_mb"] = round(cfg.data.batch_size * cfg.rollout.num_samples * cfg.rollout.max_new_tokens * a.vocab * 4
                               / 2**20, 1)
        out["large_tensors"] = box["tracer"].seen
    print(json.dumps(out))


if __name__ == "__main__":
    main()
