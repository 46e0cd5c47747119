"""Errors raised while splitting a model into stages.

Both are ``PipelineConfigError`` (a ``ValueError``): they are found before any
communication, and their messages say what was expected, what came, and how to fix it.
"""

from __future__ import annotations

from conveyor.errors import PipelineConfigError


class SplitError(PipelineConfigError):
    """The model cannot be split as asked (unknown split point, too many stages, ...)."""


class TracingError(SplitError):
    """torch.export could not trace the model; the message names the module and the operation."""
