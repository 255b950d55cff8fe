"""Layer 10, config: the typed structured-config schemas registered in Hydra's ConfigStore (``schema``).

The YAML under ``conf/`` is the source of every key's meaning; the schemas make an unknown key or a
wrong type fail at start.

May import: every layer up to ``rlhf_train.pipeline``.
"""
