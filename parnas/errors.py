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


class Interrupted(BaseException):
    """A run stopped by SIGINT or SIGTERM (:mod:`parnas.training.interrupt`).

    Not an error: the CLI exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM)
    and, on rank 0, one line saying what was saved and the command that goes on. ``checkpoint``:
    the file saved at ``step``, None when the signal came before training (nothing saved).
    ``during``: the work after the last step that the signal cut (e.g. "the final evaluation"),
    which ``--resume`` finishes. A ``BaseException``, like ``KeyboardInterrupt``, so no
    ``except Exception`` on the way swallows it.
    """

    def __init__(self, signum: int, step: int | None = None, checkpoint: str | None = None, rank: int = 0,
                 during: str | None = None) -> None:
        super().__init__(f"stopped by signal {signum} after step {step}; checkpoint {checkpoint}")
        self.signum, self.step, self.checkpoint, self.rank, self.during = signum, step, checkpoint, rank, during
