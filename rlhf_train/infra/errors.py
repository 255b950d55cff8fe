"""One exception type for bad input: its message is the single line a user sees.

:func:`instantiate_or_config_error` keeps it that way through Hydra: a :class:`ConfigError` raised while
instantiating a config node comes out as itself, not wrapped in Hydra's ``InstantiationException``.
"""


class ConfigError(ValueError):
    """Bad configuration or input, detected before training starts. The message names the key to fix."""


def instantiate_or_config_error(*args, **kwargs):
    """``hydra.utils.instantiate``, except that a :class:`ConfigError` raised by the target comes out as
    itself (the one line the user sees) rather than wrapped in Hydra's InstantiationException."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(*args, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
