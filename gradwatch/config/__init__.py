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

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
)

from gradwatch._severity import FailOn, Severity
from gradwatch.config._errors import format_validation_error
from gradwatch.config._files import load_mapping
from gradwatch.errors import ConfigError

__all__ = [
    "CheckConfig",
    "ChecksConfig",
    "DeadParamConfig",
    "ExplodingGradConfig",
    "GhostParamConfig",
    "GradWatchConfig",
    "NonfiniteGradConfig",
    "StaleParamConfig",
    "UnregisteredParamConfig",
    "VanishingGradConfig",
]

# Thresholds must be finite (``.inf`` would silently switch a check off); ints and bools are
# strict (``every_n_steps: true`` is a mistake, not 1; ``warn: 1`` is not a boolean). Floats
# accept ints, and the YAML loader reads ``1e-7`` as a number (see ``_files``).
_STRICT = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class CheckConfig(BaseModel):
    """Settings every check has."""

    model_config = _STRICT

    enabled: StrictBool = Field(default=True, description="Run this check.")
    severity: Severity = Field(default="warning", description="Severity of its findings.")


class _ErrorCheck(CheckConfig):
    severity: Severity = Field(default="error", description="Severity of its findings.")


class _InfoCheck(CheckConfig):
    severity: Severity = Field(default="info", description="Severity of its findings.")


class GhostParamConfig(_ErrorCheck):
    """``ghost_param``: a trainable parameter got no gradient in a step while others did."""

    intermittent_severity: Severity = Field(
        default="info",
        description="Severity of an intermittent ghost (missing in some steps, present in "
        "others: MoE routing, LayerDrop) in a single process or under DDP with "
        "find_unused_parameters=True. Under DDP without it (the job crashes) and for a "
        "permanent ghost: `severity`.",
    )


class ExplodingGradConfig(CheckConfig):
    """``exploding_grad``: absolute and relative limits on a layer's gradient L2 norm."""

    max_norm: Optional[StrictFloat] = Field(
        default=1e4,
        gt=0,
        description="A layer gradient norm above this fires (null: no absolute limit).",
    )
    spike_factor: StrictFloat = Field(
        default=100.0,
        gt=1,
        description="A layer norm above spike_factor x its running median (of the kept history) fires.",
    )
    warmup: StrictInt = Field(
        default=10, ge=1, description="Observed steps of a layer before the spike rule applies."
    )


class VanishingGradConfig(CheckConfig):
    """``vanishing_grad``: a layer's gradient is tiny in absolute terms *and* for its own scale.

    A layer vanishes on an observed step when its mean |grad| is below ``min_mean_abs`` (not
    zero) and its update ratio ``|Δθ|/|θ|`` (with an optimizer; without one, its gradient
    norm over its parameter norm) is below ``relative`` x the smallest such ratio among the
    model's layers whose gradients are not tiny (the slowest healthy layer).
    Adam-family optimizers rescale small gradients, so a layer with tiny gradients that
    still moves like the others (attention query/key projections at initialisation,
    LayerScale blocks) is healthy; under SGD, or with gradients so small that Adam's ``eps``
    swamps them (a deep saturated sigmoid chain), its update falls behind and it fires.
    Without such a layer to compare with, the absolute rule alone decides.
    """

    min_mean_abs: StrictFloat = Field(
        default=1e-7,
        gt=0,
        description="A layer whose mean absolute gradient is at or above this never vanishes "
        "(1e-7, as SageMaker Debugger's rule).",
    )
    relative: StrictFloat = Field(
        default=0.01,
        gt=0,
        description="...and it vanishes only when its update ratio (without an optimizer: "
        "gradient norm / parameter norm) is below this fraction of the smallest such ratio "
        "among the model's layers whose mean |grad| is at least min_mean_abs, on that step.",
    )
    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )


class DeadParamConfig(CheckConfig):
    """``dead_param``: every gradient of a layer is exactly zero."""

    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )


class StaleParamConfig(CheckConfig):
    """``stale_param``: finite non-zero gradients, yet the layer's values did not change."""

    patience: StrictInt = Field(
        default=3, ge=1, description="Consecutive observed steps before it fires."
    )


class NonfiniteGradConfig(_ErrorCheck):
    """``nonfinite_grad``: NaN/Inf in a gradient, traced to where it was born."""

    trace_steps: StrictInt = Field(
        default=20,
        ge=0,
        le=1_000_000,
        description="After the first non-finite gradient, per-module finiteness flags stay on "
        "for up to this many optimizer steps to find the module where the NaN/Inf is born "
        "(the next step where it recurs ends them). 0: never trace.",
    )


class UnregisteredParamConfig(_ErrorCheck):
    """``unregistered_param``: modules in plain list/dict/tuple attributes that train unseen."""

    scan_steps: StrictInt = Field(
        default=8,
        ge=0,
        le=1_000_000,
        description="Optimizer steps during which every module called inside the model's "
        "forward is compared with the registered ones (a global forward hook, on only "
        "during the model's forward). 0: never scan.",
    )


class ChecksConfig(BaseModel):
    """One entry per check id (see SPEC §2)."""

    model_config = _STRICT

    ghost_param: GhostParamConfig = Field(default_factory=GhostParamConfig)
    missing_zero_grad: _ErrorCheck = Field(default_factory=_ErrorCheck)
    step_without_grad: _ErrorCheck = Field(default_factory=_ErrorCheck)
    nonfinite_grad: NonfiniteGradConfig = Field(default_factory=NonfiniteGradConfig)
    exploding_grad: ExplodingGradConfig = Field(default_factory=ExplodingGradConfig)
    vanishing_grad: VanishingGradConfig = Field(default_factory=VanishingGradConfig)
    dead_param: DeadParamConfig = Field(default_factory=DeadParamConfig)
    stale_param: StaleParamConfig = Field(default_factory=StaleParamConfig)
    not_in_optimizer: CheckConfig = Field(default_factory=CheckConfig)
    frozen_in_optimizer: _InfoCheck = Field(default_factory=_InfoCheck)
    frozen_param_updated: _ErrorCheck = Field(default_factory=_ErrorCheck)
    not_observed: _ErrorCheck = Field(default_factory=_ErrorCheck)
    loss_disconnected: _ErrorCheck = Field(default_factory=_ErrorCheck)
    double_update: _ErrorCheck = Field(default_factory=_ErrorCheck)
    unregistered_param: UnregisteredParamConfig = Field(default_factory=UnregisteredParamConfig)
    clipped_while_scaled: _ErrorCheck = Field(default_factory=_ErrorCheck)


class GradWatchConfig(BaseModel):
    """Everything gradwatch can be told. Unknown keys are errors.

    Example:
        >>> cfg = GradWatchConfig.from_file("configs/ci.yaml")  # doctest: +SKIP
        >>> GradWatchConfig(every_n_steps=1).every_n_steps
        1
    """

    model_config = _STRICT

    fail_on: FailOn = Field(
        default="error",
        description="A finding at or above this severity fails the report ('never': never).",
    )
    fail_fast: StrictBool = Field(
        default=False,
        description="Raise GradWatchError at the optimizer step where the first error-level "
        "finding is seen, instead of warning.",
    )
    every_n_steps: StrictInt = Field(
        default=10,
        ge=1,
        description="Statistics cadence in optimizer steps (norms, update ratios, exploding/"
        "vanishing/dead/stale). Ghost, zero_grad and NaN/Inf checks run every step whatever "
        "it is. 10 keeps the default overhead near one clip_grad_norm_ pass.",
    )
    trim_hooks_after: Optional[StrictInt] = Field(
        default=8,
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
    history: StrictInt = Field(
        default=256, ge=1, le=100_000, description="Norm samples kept per layer for plots."
    )
    report_path: Optional[Path] = Field(
        default=None, description="Write the JSON report here when the watcher exits."
    )
    report_every_n_steps: StrictInt = Field(
        default=100,
        ge=1,
        description="With report_path: the file is also rewritten (atomically) every N steps, "
        "whenever a finding appears or changes severity, and on SIGTERM, so a preempted or "
        "killed job leaves a report.",
    )
    console: StrictBool = Field(
        default=False, description="Print the console summary when the watcher exits."
    )
    warn: StrictBool = Field(
        default=True,
        description="Emit one GradWatchWarning per (check, parameter) as findings appear.",
    )
    on_internal_error: Literal["warn", "raise"] = Field(
        default="warn",
        description="A fault inside gradwatch's own hooks: 'warn' contains it and training "
        "goes on; 'raise' re-raises (for tests).",
    )
    checks: ChecksConfig = Field(default_factory=ChecksConfig)

    @field_validator("report_path")
    @classmethod
    def _no_nul(cls, value: Optional[Path]) -> Optional[Path]:
        # A NUL byte cannot be in a file name: it would fail only when the report is written.
        if value is not None and "\x00" in str(value):
            raise ValueError("a path cannot contain a NUL byte")
        return value

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
