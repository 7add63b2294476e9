"""The error type for bad input from the user.

:class:`UserError` marks a value, path or file content the user gave that cannot work; its message names the
bad value and what would be valid. The command line prints it as one line with exit status 2
(``ssl_xcit.cli.errors``), while any other ``ValueError`` is a bug and keeps its traceback. It subclasses
``ValueError``, so code that caught ``ValueError`` from the toolkit before still catches it.
"""

from __future__ import annotations

__all__ = ["TrainingDiverged", "UserError"]


class UserError(ValueError):
    """Bad input from the user (a setting, a path, a data file): the message names it and what is valid."""


class TrainingDiverged(FloatingPointError):
    """Training stopped on a non-finite loss; the message names the step and the settings to change."""
