"""The error `dsforge run` stops with (a module of its own: the run command and its start checks both raise
it)."""

from __future__ import annotations


class RunError(Exception):
    """`dsforge run` cannot start the job; ``code`` is the CLI exit code (1 job or run failed, 2 unusable)."""

    def __init__(self, message: str, code: int = 2, report: str = "") -> None:
        super().__init__(message)
        self.code, self.report = code, report
