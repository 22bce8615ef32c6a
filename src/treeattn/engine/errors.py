"""The engine's errors: a bad option (ConfigError, naming it) and an engine that cannot go on (EngineError).

    try:
        EngineConfig(block_size=0)
    except ConfigError as exc:
        exc.option                     # "block_size": the command line turns it into --block-size
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad option. `option` is the field's name ("top_p"), for the CLI's flag."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


class ConfigTypeError(ConfigError, TypeError):
    """An option of the wrong type (a TypeError too)."""


class EngineError(RuntimeError):
    """The engine cannot go on (a rank died or failed); every pending request has failed."""


class StepFailed(EngineError):
    """A step raised on the ranks or a rank died during it. `summary` is one line (no traceback),
    fit for the requests that the step failed; str() keeps the rank's traceback for the log."""

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary
