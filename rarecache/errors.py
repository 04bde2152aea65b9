"""One exception type for user mistakes.

The CLI prints a RarecacheError as a one-line message and exits non-zero; any other
exception is a bug and keeps its traceback.
"""


class RarecacheError(Exception):
    """A problem with the user's input, files or environment (not a bug)."""
