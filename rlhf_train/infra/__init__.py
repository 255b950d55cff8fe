"""Layer 1, infra: the machinery every stage shares, with no RL in it.

The one-line ``ConfigError`` (``errors``), multi-process helpers for DDP / FSDP / DeepSpeed / gloo
(``distributed``), atomic checkpoints and resume (``checkpoint``), SIGTERM / SIGINT handling
(``preemption``), W&B / CSV / no-op metric loggers (``logger``), the writable-run-dir check
(``run_dir``) and the process-wide CPU settings of the entry point and benchmarks (``cpu_defaults``).

May import: ``rlhf_train.core`` (below it) and itself.
"""
