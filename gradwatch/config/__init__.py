"""The configuration model, loaded from YAML, TOML or JSON.

``checks`` has one entry per registered check (:data:`gradwatch.checks.ALL_CHECKS`), typed by
the check's own ``Config`` from its module; this package re-exports the ones with thresholds.

Example:
    >>> import gradwatch
    >>> cfg = gradwatch.GradWatchConfig(fail_on="warning", ignore=["head.*"])
    >>> cfg.checks.vanishing_grad.min_mean_abs
    1e-07
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    create_model,
    field_validator,
)

from gradwatch._severity import FailOn
from gradwatch.checks.base import STRICT, CheckConfig
from gradwatch.checks.dead import DeadParamConfig
from gradwatch.checks.exploding import ExplodingGradConfig
from gradwatch.checks.ghost import GhostParamConfig
from gradwatch.checks.nonfinite import NonfiniteGradConfig
from gradwatch.checks.registry import ALL_CHECKS
from gradwatch.checks.stale import StaleParamConfig
from gradwatch.checks.unregistered import UnregisteredParamConfig
from gradwatch.checks.vanishing import VanishingGradConfig
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


class _ChecksBase(BaseModel):
    """One entry per check id (see SPEC §2)."""

    model_config = STRICT

    if TYPE_CHECKING:
        # The entries are made from the registry at import time (below), so a type checker
        # cannot list them: ``checks.<id>`` reads as Any; ``GradWatchConfig.check(id)`` is typed.
        def __getattr__(self, check_id: str) -> Any: ...


# Each check's settings live in its module (its ``Config``); one entry per registered check, in
# registry order, so adding a check to ALL_CHECKS adds its entry (and its part of the schema).
if TYPE_CHECKING:
    ChecksConfig = _ChecksBase
else:
    ChecksConfig = create_model(
        "ChecksConfig",
        __base__=_ChecksBase,
        __module__=__name__,
        **{cls.id: (cls.Config, Field(default_factory=cls.Config)) for cls in ALL_CHECKS},
    )
    # Not ``create_model(__doc__=...)``: pydantic before 2.7 (the floor is 2.4.2) takes it for
    # a field, warns and drops it.
    ChecksConfig.__doc__ = _ChecksBase.__doc__


class GradWatchConfig(BaseModel):
    """Everything gradwatch can be told. Unknown keys are errors.

    Example:
        >>> cfg = GradWatchConfig.from_file("configs/ci.yaml")  # doctest: +SKIP
        >>> GradWatchConfig(every_n_steps=1).every_n_steps
        1
    """

    model_config = STRICT

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
        description="Emit one GradWatchWarning per finding (however many parameters it "
        "names) when it first reaches warning or error, pointing at the user's line (the "
        "first frame outside gradwatch, torch, Lightning, transformers and accelerate).",
    )
    on_internal_error: Literal["warn", "raise"] = Field(
        default="warn",
        description="A fault inside gradwatch's own hooks: 'warn' contains it and training "
        "goes on; 'raise' re-raises (for tests).",
    )
    preview: StrictBool = Field(
        default=False,
        description="Let the checks in preview (not yet proven on the clean corpus of correct "
        "programs; `gradwatch explain ID` says which) report at their own severity. Off, "
        "their findings are info, marked preview, and fail nothing.",
    )
    probes: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="The loss-free probes (sample_dependence, gradient_mismatch along a random "
        "projection of the outputs, forward_not_reproducible, batch_order_dependent, "
        "dependence_outside_receptive_field) run once inside watch(), on a copy, on the first batch "
        "the model trains on, after its first step, within the time of 10 training steps. "
        "'auto': when the model has at most 200M parameters and its copies fit in half the "
        "free memory of its device; 'on': any size, within the free memory; 'off': never. "
        "A YAML on/off (a boolean) means on/off.",
    )
    checks: ChecksConfig = Field(default_factory=ChecksConfig)

    @field_validator("probes", mode="before")
    @classmethod
    def _probes_bool(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean.
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

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
