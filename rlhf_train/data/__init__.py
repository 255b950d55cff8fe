"""Generic prompt data (the ``data`` config group) and tokenizer factories (the ``tokenizer`` group).

Task-specific data (the embedded default's movie reviews) lives in :mod:`rlhf_train.tasks`.
"""
