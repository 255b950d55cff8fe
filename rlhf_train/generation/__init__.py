"""Layer 4, generation: prompt tokens in, response tokens out.

``base`` defines the seam (``Generation``, the ``GenerationBackend`` protocol); ``hf_generate`` is the
backend built on ``transformers``' ``generate``.

May import: ``rlhf_train.core``, ``infra``, ``models``, ``data``. Sibling of ``rlhf_train.rewards``
(same rank: either may import the other, nothing above may be imported).

Extension point: a new generation backend (vLLM, SGLang, a custom decode loop, ...) goes in
``rlhf_train/generation/<name>.py`` as a class implementing ``GenerationBackend``
(``rlhf_train/generation/base.py``).
"""
