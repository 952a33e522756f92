"""Typed errors for user mistakes.

The library raises these; the CLI turns any of them into one line on stderr and
exit status 2. Anything else is a bug and keeps its traceback.
"""


class ParnasError(Exception):
    """A problem with what the user asked for, explained in one line."""


class ConfigError(ParnasError):
    """A configuration key, type or value that cannot be honoured."""


class DataError(ParnasError):
    """A corpus that is missing, corrupt, empty or too small."""


class TokenizerError(ParnasError):
    """A tokenizer that cannot be trained or loaded with the given settings."""
