"""User-facing errors.

A `PartcError` carries one line for the user. The CLI prints it as ``error: <line>`` and exits with code 2,
without a traceback. Internal invariants use `assert`; everything a user can cause raises `PartcError`.
"""


class PartcError(ValueError):
    """An error caused by user input (model file, options, plan file). The message is one line."""
