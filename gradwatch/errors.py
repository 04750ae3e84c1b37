"""Exceptions and warnings raised by gradwatch."""

from __future__ import annotations

__all__ = ["ConfigError", "GhostLayerError", "GradWatchError", "GradWatchWarning"]


class GradWatchError(RuntimeError):
    """A finding at or above ``fail_on`` (``fail_fast`` or ``raise_for_findings``) or bad input."""


class GhostLayerError(GradWatchError):
    """Trainable parameters received no gradient (check ``ghost_param``)."""


class ConfigError(GradWatchError, ValueError):
    """A configuration value, file or target that gradwatch cannot use.

    The message is one line that names the culprit (file, field, allowed values).
    """


class GradWatchWarning(UserWarning):
    """A finding, surfaced once per (check, parameter) while training goes on."""
