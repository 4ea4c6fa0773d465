"""The one exception type a user is meant to see."""


class InfernoError(Exception):
    """Bad input or an impossible request: shown as one line on stderr, exit code 2."""
