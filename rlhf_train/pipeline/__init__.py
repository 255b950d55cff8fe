"""Layer 9, pipeline: the stages and the sentiment pipelines' (SFT ->) reward model -> RL -> evaluation run.

``stages`` dispatches on ``cfg.stage``; ``plan`` decides, before any work, which stages run (their
content keys for the stage cache, ``cache``) and checks their inputs; ``run`` executes the plan; ``sft`` and ``reward_training`` train the SFT policy and the reward model; ``evaluate``
compares the policy before and after the RL stage; ``sweep`` writes the report of a Hydra multirun
(its figure: ``sweep_figure``).

May import: every layer up to ``rlhf_train.loop``.
"""
