"""Domain errors: everything a user can cause raises a QtoolError subclass.

The CLI turns these into one line on stderr and an exit code; any other exception is a bug (or
a model qtool does not handle yet), also one line, with its own exit code.
"""

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3

# the signals (Ctrl-C, SIGTERM) the command line received: an output is not put in place once one
# came, even where the exception it raised was swallowed on the way (numba's compiler callbacks)
STOP: list[int] = []


class QtoolError(Exception):
    """A problem the user can fix: bad file, bad key, unsupported op..."""

    exit_code = EXIT_USER_ERROR


class DataError(QtoolError):
    """What the data hold is wrong for the model, whatever the batch: a command that chose its
    batch size does not retry one sample at a time on it (it would only fail again, later)."""


class IndexOutOfRange(QtoolError):
    """An index the data holds that a table does not have (a token id beyond an embedding's rows):
    raised by a kernel, named with its node by the executor."""


class VerificationFailed(QtoolError):
    """The quantized model ran but missed a tolerance."""

    exit_code = EXIT_VERIFY_FAILED
