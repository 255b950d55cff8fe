"""Layer 8, loop: the RL training loop, for every algorithm.

``trainer``: ``train(cfg)`` = ``build_run`` + a loop over ``step(run, state, batch)`` (rollout, advantages,
update, KL-controller step, metrics), with logging, checkpoints, preemption and export around it;
``build``: ``build_run(cfg) -> Run``, each decision made once; ``components``: one builder per config
group; ``checks``: every pre-flight check; ``state``: the typed ``TrainState``; ``metrics``: what is logged.

May import: every layer up to ``rlhf_train.tasks``.
"""
