"""The configuration model: one sub-model per check, loaded from YAML, TOML or JSON.

Example:
    >>> import gradwatch
    >>> cfg = gradwatch.GradWatchConfig(fail_on="warning", ignore=["head.*"])
    >>> cfg.checks.vanishing_grad.min_mean_abs
    1e-07
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gradwatch._severity import FailOn, Severity
from gradwatch.config._errors import format_validation_error
from gradwatch.config._files import load_mapping
from gradwatch.errors import ConfigError

__all__ = [
    "CheckConfig",
    "ChecksConfig",
    "DeadParamConfig",
    "ExplodingGradConfig",
    "GradWatchConfig",
    "StaleParamConfig",
    "VanishingGradConfig",
]

_STRICT = ConfigDict(extra="forbid", validate_assignment=True)


class CheckConfig(BaseModel):
    """Settings every check has."""

    model_config = _STRICT

    enabled: bool = Field(True, description="Run this check.")
    severity: Severity = Field("warning", description="Severity of its findings.")


class _ErrorCheck(CheckConfig):
    severity: Severity = Field("error", description="Severity of its findings.")


class _InfoCheck(CheckConfig):
    severity: Severity = Field("info", description="Severity of its findings.")


class ExplodingGradConfig(CheckConfig):
    """``exploding_grad``: absolute and relative limits on a layer's gradient L2 norm."""

    max_norm: Optional[float] = Field(
        1e4, gt=0, description="A layer gradient norm above this fires (null: no absolute limit)."
    )
    spike_factor: float = Field(
        100.0,
        gt=1,
        description="A layer norm above spike_factor x its running median (of the kept history) fires.",
    )
    warmup: int = Field(
        10, ge=1, description="Observed steps of a layer before the spike rule applies."
    )


class VanishingGradConfig(CheckConfig):
    """``vanishing_grad``: a layer's mean |grad| stays tiny but non-zero."""

    min_mean_abs: float = Field(
        1e-7,
        gt=0,
        description="Mean absolute gradient over a layer below this counts as vanishing "
        "(1e-7, as SageMaker Debugger's rule).",
    )
    patience: int = Field(3, ge=1, description="Consecutive observed steps before it fires.")


class DeadParamConfig(CheckConfig):
    """``dead_param``: every gradient of a layer is exactly zero."""

    patience: int = Field(3, ge=1, description="Consecutive observed steps before it fires.")


class StaleParamConfig(CheckConfig):
    """``stale_param``: finite non-zero gradients, yet the layer's values did not change."""

    patience: int = Field(3, ge=1, description="Consecutive observed steps before it fires.")


class ChecksConfig(BaseModel):
    """One entry per check id (see SPEC §2)."""

    model_config = _STRICT

    ghost_param: _ErrorCheck = Field(default_factory=_ErrorCheck)
    missing_zero_grad: _ErrorCheck = Field(default_factory=_ErrorCheck)
    step_without_grad: _ErrorCheck = Field(default_factory=_ErrorCheck)
    nonfinite_grad: _ErrorCheck = Field(default_factory=_ErrorCheck)
    exploding_grad: ExplodingGradConfig = Field(default_factory=ExplodingGradConfig)
    vanishing_grad: VanishingGradConfig = Field(default_factory=VanishingGradConfig)
    dead_param: DeadParamConfig = Field(default_factory=DeadParamConfig)
    stale_param: StaleParamConfig = Field(default_factory=StaleParamConfig)
    not_in_optimizer: CheckConfig = Field(default_factory=CheckConfig)
    frozen_in_optimizer: _InfoCheck = Field(default_factory=_InfoCheck)
    frozen_param_updated: _ErrorCheck = Field(default_factory=_ErrorCheck)
    not_observed: _ErrorCheck = Field(default_factory=_ErrorCheck)


class GradWatchConfig(BaseModel):
    """Everything gradwatch can be told. Unknown keys are errors.

    Example:
        >>> cfg = GradWatchConfig.from_file("configs/ci.yaml")  # doctest: +SKIP
        >>> GradWatchConfig(every_n_steps=1).every_n_steps
        1
    """

    model_config = _STRICT

    fail_on: FailOn = Field(
        "error",
        description="A finding at or above this severity fails the report ('never': never).",
    )
    fail_fast: bool = Field(
        False,
        description="Raise GradWatchError at the optimizer step where the first error-level "
        "finding is seen, instead of warning.",
    )
    every_n_steps: int = Field(
        10,
        ge=1,
        description="Statistics cadence in optimizer steps (norms, update ratios, exploding/"
        "vanishing/dead/stale). Ghost, zero_grad and NaN/Inf checks run every step whatever "
        "it is. 10 keeps the default overhead near one clip_grad_norm_ pass.",
    )
    trim_hooks_after: Optional[int] = Field(
        8,
        ge=0,
        description="Every hook stays on for the first N optimizer steps. After that, forward "
        "hooks (a ghost's cause) stay only on layers that were ghosts, and value-check hooks "
        "(missing zero_grad) only on parameters whose gradient resets the version counter "
        "cannot tell apart; a problem that appears later gets them back from its next step "
        "(a late ghost's cause is 'unknown' once). null keeps every hook on; so does fail_fast.",
    )
    ignore: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns over parameter names whose findings are silenced.",
    )
    history: int = Field(
        256, ge=1, le=100_000, description="Norm samples kept per layer for plots."
    )
    report_path: Optional[Path] = Field(
        None, description="Write the JSON report here when the watcher exits."
    )
    report_every_n_steps: int = Field(
        100,
        ge=1,
        description="With report_path: the file is also rewritten (atomically) every N steps, "
        "whenever a finding appears or changes severity, and on SIGTERM, so a preempted or "
        "killed job leaves a report.",
    )
    console: bool = Field(False, description="Print the console summary when the watcher exits.")
    warn: bool = Field(
        True, description="Emit one GradWatchWarning per (check, parameter) as findings appear."
    )
    on_internal_error: Literal["warn", "raise"] = Field(
        "warn",
        description="A fault inside gradwatch's own hooks: 'warn' contains it and training "
        "goes on; 'raise' re-raises (for tests).",
    )
    checks: ChecksConfig = Field(default_factory=ChecksConfig)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> GradWatchConfig:
        """Load a config from ``.yaml``/``.yml``, ``.toml`` or ``.json``.

        A ``pyproject.toml`` is read from its ``[tool.gradwatch]`` table. Loading never
        executes code (``yaml.safe_load``).

        Raises:
            ConfigError: one line naming the file, the field and what is allowed.
        """
        data = load_mapping(Path(path))
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, cls, source=str(path))) from None

    @classmethod
    def coerce(
        cls, value: Union[GradWatchConfig, dict[str, Any], str, Path, None]
    ) -> GradWatchConfig:
        """Turn what ``watch(config=...)`` accepts into a config.

        Raises:
            ConfigError: for a bad dict, file or type, with a one-line reason.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, Path)):
            return cls.from_file(value)
        if isinstance(value, dict):
            try:
                return cls.model_validate(value)
            except ValidationError as exc:
                raise ConfigError(format_validation_error(exc, cls, source="config")) from None
        raise ConfigError(
            f"config must be a GradWatchConfig, a dict or a path, not {type(value).__name__}"
        )

    def check(self, check_id: str) -> CheckConfig:
        """The settings of one check by id."""
        cfg = getattr(self.checks, check_id, None)
        if not isinstance(cfg, CheckConfig):
            raise KeyError(check_id)
        return cfg
