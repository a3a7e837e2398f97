"""Domain errors: everything a user can cause raises a QtoolError subclass.

The CLI turns these into one line on stderr and an exit code; any other exception is a bug (or
a model qtool does not handle yet), also one line, with its own exit code.
"""

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERNAL_ERROR = 3


class QtoolError(Exception):
    """A problem the user can fix: bad file, bad key, unsupported op..."""

    exit_code = EXIT_USER_ERROR


class VerificationFailed(QtoolError):
    """The quantized model ran but missed a tolerance."""

    exit_code = EXIT_VERIFY_FAILED
