"""The exception types refmp stops on cleanly (refmp.cli.main prints one message, from rank 0)."""


class ConfigError(ValueError):
    """Bad input from the user (layouts, flags, files), found before the first step on every
    rank: refmp prints the message once and every rank exits with status 2."""


class TrainingError(RuntimeError):
    """A run that cannot go on, seen by every rank at the same step (a non-finite loss or
    gradient norm: global values): refmp prints the message once and exits with status 3."""
