"""Command-line tools that check a run (``python -m rlhf_train.tools.<name>``)."""
