"""The one exception type a user should ever see from hftrain.

An ``HftrainError`` is a problem the user can fix (a bad recipe key, a missing file, a malformed line).
The CLI prints its message alone, without a traceback, and exits with status 2. Anything else that
escapes is a bug in hftrain and keeps its traceback.
"""


class HftrainError(Exception):
    """A user-fixable problem; ``str(err)`` is the complete message."""


class Preempted(HftrainError):
    """Training stopped on a preemption signal after saving a checkpoint; running again continues it."""

    exit_code = 75  # EX_TEMPFAIL, what the SLURM template requeues on
