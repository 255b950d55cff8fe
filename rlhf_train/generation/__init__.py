"""Layer 4, generation: prompt tokens in, response tokens out.

``base`` defines the seam (``Generation``, the ``GenerationBackend`` protocol); ``decode_loop`` is the
default backend (rlhf_train's KV-cached loop), ``static_cache`` the same loop over a static KV cache with its
step compiled (CUDA graphs on GPUs), ``auto`` the choice between them by device, ``hf_generate`` the one
built on ``transformers``' ``generate``. The config group ``generation`` (``conf/generation/<name>.yaml``)
selects one by ``_target_``.

May import: ``rlhf_train.core``, ``infra``, ``models``, ``data``. Sibling of ``rlhf_train.rewards``
(same rank: either may import the other, nothing above may be imported).

Extension point: a new generation backend (vLLM, SGLang, ...) goes in
``rlhf_train/generation/<name>.py`` as a class implementing ``GenerationBackend``
(``rlhf_train/generation/base.py``), plus ``conf/generation/<name>.yaml``.
"""
