"""The one exception type for bad input (layouts, flags, files)."""


class ConfigError(ValueError):
    """Bad input from the user: refmp prints the message on every rank and exits non-zero."""
