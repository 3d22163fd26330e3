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


class BackendBroken(RuntimeError):
    """A decode round failed, a rank was lost or a collective timed out: nothing more can run.

    Raised by rank 0's Leader and caught by the lane host; the ranks may disagree, so the pair stops."""


class ChunkRefused(RuntimeError):
    """Some rank refused a prompt chunk that rode with a decode round: neither ran anywhere. The lane
    host ends that prompt's request alone and runs the round again without it."""
