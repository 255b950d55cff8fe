"""One exception type for bad input: its message is the single line a user sees."""


class ConfigError(ValueError):
    """Bad configuration or input, detected before training starts. The message names the key to fix."""
