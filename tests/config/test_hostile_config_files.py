"""Hostile config files: deep nesting, huge values, huge files, non-finite and mistyped values."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gradwatch import ConfigError, GradWatchConfig
from gradwatch.config._files import MAX_CONFIG_BYTES


def load(tmp_path: Path, name: str, content: str) -> GradWatchConfig:
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    return GradWatchConfig.from_file(path)


def one_line(err: pytest.ExceptionInfo[ConfigError], tmp_path: Path, name: str) -> str:
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{tmp_path / name}: "), text
    return text


DEEP = 100_000
NESTED = {
    "deep.json": '{"ignore": ' + "[" * DEEP + "]" * DEEP + "}",
    "deep.yaml": "ignore: " + "[" * DEEP + "]" * DEEP + "\n",
    "deep.toml": "ignore = " + "[" * DEEP + "]" * DEEP + "\n",
    "deep-tables.toml": "x = " + "{a=" * DEEP + "1" + "}" * DEEP + "\n",
}


@pytest.mark.parametrize("name", sorted(NESTED))
def test_deep_nesting_is_a_config_error_naming_the_file(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, name, NESTED[name])
    assert "nested too deeply" in one_line(err, tmp_path, name)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("tool = 3\n", "'tool' must be a table, not int"),
        ('[tool]\ngradwatch = "strict"\n', "'tool.gradwatch' must be a table of settings"),
    ],
)
def test_pyproject_with_a_non_table_tool(content: str, fragment: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "pyproject.toml", content)
    assert fragment in one_line(err, tmp_path, "pyproject.toml")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("c.yaml", "fail_on: " + "x" * 1_000_000 + "\n"),
        ("c.json", '{"' + "k" * 500_000 + '": 1}'),
        ("c.json", '{"history": ' + "9" * 5000 + "}"),  # repr() of it would raise
        ("c.yaml", "history: " + "9" * 5000 + "\n"),
    ],
)
def test_a_huge_bad_value_is_clipped_in_the_message(
    name: str, content: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, name, content)
    assert len(one_line(err, tmp_path, name)) < 600


def test_config_size_is_capped(tmp_path: Path) -> None:
    content = "ignore:\n" + "  - 'layer.*'\n" * (MAX_CONFIG_BYTES // 12)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "big.yaml", content)
    assert time.perf_counter() - start < 5  # refused before parsing
    assert "larger than 1 MiB" in one_line(err, tmp_path, "big.yaml")


def test_a_fifo_config_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "c.yaml")
    with pytest.raises(ConfigError) as err:
        GradWatchConfig.from_file(tmp_path / "c.yaml")
    assert "not a regular file" in one_line(err, tmp_path, "c.yaml")


def test_a_yaml_alias_bomb_is_quick(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    start = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "bomb.yaml", "\n".join(lines) + "\nignore: *a8\n")
    assert time.perf_counter() - start < 10
    assert "unknown key 'a0'" in one_line(err, tmp_path, "bomb.yaml")


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        ("checks:\n  vanishing_grad: {min_mean_abs: .inf}\n", ["min_mean_abs", "finite"]),
        ("checks:\n  vanishing_grad: {min_mean_abs: .nan}\n", ["min_mean_abs", "finite"]),
        ("checks:\n  exploding_grad: {max_norm: .inf}\n", ["max_norm", "finite"]),
        ("checks:\n  exploding_grad: {spike_factor: .inf}\n", ["spike_factor", "finite"]),
        ("every_n_steps: true\n", ["every_n_steps", "integer", "(got True)"]),
        ("history: 2.0\n", ["history", "integer"]),
        ("trim_hooks_after: '8'\n", ["trim_hooks_after", "integer"]),
        ("warn: 1\n", ["warn", "boolean"]),
        ("checks:\n  dead_param: {enabled: 'yes'}\n", ["enabled", "boolean"]),
        ("checks:\n  vanishing_grad: {min_mean_abs: true}\n", ["min_mean_abs", "number"]),
        ('report_path: "out\\0.json"\n', ["report_path", "NUL byte"]),
    ],
)
def test_non_finite_thresholds_wrong_types_and_nul_paths_are_rejected(
    content: str, fragments: list[str], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, "c.yaml", content)
    text = one_line(err, tmp_path, "c.yaml")
    for fragment in fragments:
        assert fragment in text, text


def test_numbers_written_as_numbers_still_load(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        "c.yaml",
        "every_n_steps: 5\nhistory: 1_000\n"
        + "checks:\n  vanishing_grad: {min_mean_abs: 1e-7}\n"
        + "  exploding_grad: {max_norm: 100, spike_factor: 2.5E+1}\n",
    )
    assert cfg.every_n_steps == 5 and cfg.history == 1000
    assert cfg.checks.vanishing_grad.min_mean_abs == 1e-7
    assert cfg.checks.exploding_grad.max_norm == 100.0
    assert cfg.checks.exploding_grad.spike_factor == 25.0
    toml = load(tmp_path, "c.toml", "[checks.vanishing_grad]\nmin_mean_abs = 1e-7\n")
    assert toml.checks.vanishing_grad.min_mean_abs == 1e-7
    assert GradWatchConfig(every_n_steps=3, checks={"exploding_grad": {"max_norm": 5}})


def test_python_configs_are_strict_too() -> None:
    with pytest.raises(ConfigError, match="every_n_steps"):
        GradWatchConfig.coerce({"every_n_steps": True})
    with pytest.raises(ConfigError, match="min_mean_abs"):
        GradWatchConfig.coerce({"checks": {"vanishing_grad": {"min_mean_abs": float("inf")}}})
