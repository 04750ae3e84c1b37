"""GradWatchConfig: defaults, files, and one-line errors that name file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

import gradwatch
from gradwatch import ConfigError, GradWatchConfig

CONFIGS = Path(__file__).parents[2] / "configs"


def test_shipped_configs_load() -> None:
    default = GradWatchConfig.from_file(CONFIGS / "default.yaml")
    assert default == GradWatchConfig()
    ci = GradWatchConfig.from_file(CONFIGS / "ci.yaml")
    assert ci.fail_on == "warning" and ci.every_n_steps == 1
    assert ci.checks.dead_param.patience == 2


def test_default_yaml_is_the_default_config_written_out() -> None:
    """Every key with its default: regenerated here, so a new field or check cannot be missed."""
    import yaml

    from gradwatch.config._dump import default_yaml

    text = (CONFIGS / "default.yaml").read_text(encoding="utf-8")
    assert text == default_yaml(), (
        "configs/default.yaml is out of date: python -m gradwatch.config._dump configs/default.yaml"
    )
    # Any YAML reader gets the defaults back (not only gradwatch's, which reads 1e-7 as a float).
    assert yaml.safe_load(text) == GradWatchConfig().model_dump(mode="json")


@pytest.mark.parametrize(
    "value", [None, True, 0, 10_000.0, 1e-7, 2.5e12, "error", "yes", "a: b", "", ["x.*", "no"], {}]
)
def test_default_yaml_values_read_back_as_written(value: object) -> None:
    import yaml

    from gradwatch.config._dump import _scalar

    assert yaml.safe_load(f"key: {_scalar(value)}") == {"key": value}


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_every_format(tmp_path: Path, suffix: str) -> None:
    text = {
        ".json": '{"fail_on": "warning", "checks": {"vanishing_grad": {"patience": 5}}}',
        ".toml": 'fail_on = "warning"\n[checks.vanishing_grad]\npatience = 5\n',
        ".yaml": "fail_on: warning\nchecks:\n  vanishing_grad: {patience: 5}\n",
    }[suffix]
    path = tmp_path / f"gw{suffix}"
    path.write_text(text)
    cfg = GradWatchConfig.from_file(path)
    assert cfg.fail_on == "warning" and cfg.checks.vanishing_grad.patience == 5


def test_pyproject_tool_table(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n[tool.gradwatch]\nignore = ["head.*"]\n')
    assert GradWatchConfig.from_file(path).ignore == ["head.*"]


def test_unknown_key_names_file_and_allowed_keys(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("checks:\n  vanishing_grad:\n    min_mean: 1.0\n")
    with pytest.raises(ConfigError) as info:
        GradWatchConfig.from_file(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    assert "checks.vanishing_grad.min_mean" in msg and "min_mean_abs" in msg


def test_wrong_value_names_field_and_allowed_values(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"fail_on": "sometimes"}')
    with pytest.raises(
        ConfigError, match=r"fail_on: .*'info', 'warning', 'error' or 'never'.*sometimes"
    ):
        GradWatchConfig.from_file(path)


def test_watch_accepts_a_path_and_a_dict(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "c.yaml"
    path.write_text("every_n_steps: 3\n")
    model = torch.nn.Linear(2, 2)
    assert gradwatch.watch(model, config=path).config.every_n_steps == 3
    assert gradwatch.watch(model, config={"every_n_steps": 4}).config.every_n_steps == 4
    with pytest.raises(ConfigError, match="every_n_steps"):
        gradwatch.watch(model, config={"every_n_steps": 0})
