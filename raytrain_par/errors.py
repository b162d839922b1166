"""Errors a user can act on: each names what is wrong, the value found and the fix; and `say`, the
default log of the commands whose log Ray Tune may pickle (sweep, plan, reproduce)."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Bad input found before anything runs. The CLI prints it without a traceback."""


class ConfigError(UserError):
    def __init__(self, field: str, value: Any, problem: str, fix: str, source: str | None = None):
        self.field, self.value, self.problem, self.fix, self.source = field, value, problem, fix, source
        super().__init__(self._format())

    def _format(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.field} = {self.value!r}: {self.problem}\n  fix: {self.fix}"

    def __reduce__(self):  # raised in a Ray worker, it travels back to the driver pickled
        return type(self), (self.field, self.value, self.problem, self.fix, self.source)

    def with_source(self, source: str) -> "ConfigError":
        self.source = source
        self.args = (self._format(),)
        return self


class DataUnavailable(UserError):
    """A data set the experiment needs is not on this machine."""


def say(*parts) -> None:
    """The default log of the commands: print as it is when called. Ray replaces builtins.print once
    imported, and Tune pickles a sweep's log function with its state, which fails for a `print` taken
    before that ("Can't pickle <built-in function print>: it's not the same object")."""
    print(*parts, flush=True)
