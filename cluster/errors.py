"""Errors the command line reports as one line with exit code 2."""


class CLIError(Exception):
    """A user error: printed as `loraplex: error: ...`, exit code 2."""
