"""Layer 3, data: generic prompt datasets (the ``data`` config group) and tokenizer factories
(the ``tokenizer`` config group).

``prompts`` holds ``PromptDataset``, synthetic and TL;DR prompts and their collate function; ``hf_prompts``
your prompts (``data=prompts``: text or chat messages from any ``datasets`` source, with their columns);
``prefix`` the system prompt and few-shot examples put before each of them; ``questions`` questions with
answers (rows a task made or loaded) as chat prompts;
``loading`` reads a dataset for both (a file, a dir, a ``save_to_disk`` dir or a hub name, failing fast
offline; a held-out split for datasets without one); ``files`` checks local data files (0 bytes, not UTF-8,
malformed JSON, an empty dir) and names the file and line of a row; ``rows`` decides text or chat from every
row and names the first invalid one; ``checks`` is the data's pre-flight, before any model is built;
``tokenizers`` loads pretrained tokenizers and checks that a tokenizer has what the trainer needs.
Task-specific data (the embedded default's movie reviews) lives in :mod:`rlhf_train.tasks`.

May import: ``rlhf_train.core``, ``rlhf_train.infra``, ``rlhf_train.models``.
"""
