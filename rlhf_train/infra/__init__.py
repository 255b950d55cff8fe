"""Layer 1, infra: the machinery every stage shares, with no RL in it.

The one-line ``ConfigError`` and Hydra instantiation that keeps it one line (``errors``), multi-process
helpers for DDP / FSDP / DeepSpeed / gloo (``distributed``), atomic checkpoints: their files, manifest and
RNG states (``checkpoint_files``), writing one (``checkpoint``), where an export may go (``export_dir``),
finding, verifying and loading the one to resume (``resume``) and the base-model fingerprint it checks
(``fingerprint``); SIGTERM / SIGINT handling (``preemption``), W&B / CSV / no-op metric loggers
(``logger``), redacting secrets (``secrets``), the writable-run-dir check (``run_dir``), cache entries
sealed, verified on reuse and their stale temp dirs removed (``cache_entries``), the process-wide CPU
settings of the entry point and benchmarks (``cpu_defaults``) and giving a finished stage's freed memory back
to the operating system (``memory``).

May import: ``rlhf_train.core`` (below it) and itself.
"""
