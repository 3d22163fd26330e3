"""Errors a user can act on: the command line prints them as one line and exits 2."""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """Bad input from the user (a file, a flag, a prompt): one clear line, no traceback."""


class ModelFileError(UserError):
    """A model file is missing, malformed or unsupported."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class StartupError(UserError):
    """A rank could not start: another never arrived, flags differ, or there is no room."""
