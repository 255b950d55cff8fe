"""Layer 11, tools: command-line tools that check a run (``python -m rlhf_train.tools.<name>``).

``resume_check`` kills a run mid-way, resumes it and compares it with an uninterrupted run.
``launch`` is ``accelerate launch`` that exits 143 when preempted (schedulers requeue on it).
``export`` writes a checkpoint as a plain Hugging Face model dir (with LoRA: the merged model + the adapter).
``sweep_report`` writes a sweep's report from its job dirs (a sweep that was killed before writing it).

May import: every layer below it (up to ``rlhf_train.config``); only ``rlhf_train.__main__`` sits above.
"""
