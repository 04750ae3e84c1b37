"""Bad input fails with one clear line naming the culprit, never a deep traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import ConfigError, GradWatchConfig

# (file name, content, fragments the one-line error must contain besides the file name)
BAD_FILES = {
    "yaml-syntax": ("c.yaml", "fail_on: [unclosed\n", ["invalid YAML", "line 2"]),
    "yml-syntax": ("c.yml", "checks:\n  ghost_param: {enabled: true\n", ["invalid YAML"]),
    "toml-syntax": ("c.toml", "fail_on = \n", ["invalid TOML", "line 1"]),
    "json-syntax": ("c.json", '{"fail_on": }', ["invalid JSON", "line 1, column 13"]),
    "unknown-top-key": (
        "c.yaml",
        "colour: true\n",
        ["unknown key 'colour'", "allowed: fail_on, fail_fast, every_n_steps"],
    ),
    "unknown-check-key": (
        "c.yaml",
        "checks:\n  ghost_param:\n    enable: false\n",
        ["unknown key 'checks.ghost_param.enable'", "allowed: enabled, severity"],
    ),
    "unknown-threshold": (
        "c.toml",
        "[checks.exploding_grad]\nmax_nrom = 5.0\n",
        ["checks.exploding_grad.max_nrom", "max_norm", "spike_factor", "warmup"],
    ),
    "unknown-check-id": (
        "c.json",
        '{"checks": {"ghosts": {}}}',
        ["unknown key 'checks.ghosts'", "ghost_param", "frozen_in_optimizer"],
    ),
    "wrong-type-int": ("c.yaml", "every_n_steps: often\n", ["every_n_steps", "integer", "'often'"]),
    "wrong-type-bool": ("c.yaml", "warn: 3\n", ["warn:", "boolean", "(got 3)"]),
    "wrong-type-list": ("c.yaml", "ignore: 'head.*'\n", ["ignore:", "list", "'head.*'"]),
    "wrong-type-section": (
        "c.yaml",
        "checks:\n  dead_param: 5\n",
        ["checks.dead_param", "(got 5)"],
    ),
    "wrong-choice": (
        "c.yaml",
        "fail_on: fatal\n",
        ["fail_on:", "'info', 'warning', 'error' or 'never'", "'fatal'"],
    ),
    "wrong-severity": (
        "c.toml",
        '[checks.stale_param]\nseverity = "critical"\n',
        ["checks.stale_param.severity", "'info', 'warning' or 'error'", "'critical'"],
    ),
    "wrong-mode": (
        "c.json",
        '{"on_internal_error": "ignore"}',
        ["on_internal_error", "'warn' or 'raise'"],
    ),
    "out-of-range-cadence": ("c.toml", "every_n_steps = 0\n", ["every_n_steps", ">= 1", "(got 0)"]),
    "out-of-range-spike": (
        "c.json",
        '{"checks": {"exploding_grad": {"spike_factor": 0.5}}}',
        ["checks.exploding_grad.spike_factor", "greater than 1", "0.5"],
    ),
    "out-of-range-max-norm": (
        "c.yaml",
        "checks:\n  exploding_grad:\n    max_norm: -1\n",
        ["checks.exploding_grad.max_norm", "greater than 0"],
    ),
    "out-of-range-threshold": (
        "c.yaml",
        "checks:\n  vanishing_grad:\n    min_mean_abs: 0\n",
        ["checks.vanishing_grad.min_mean_abs", "greater than 0"],
    ),
    "out-of-range-patience": (
        "c.yaml",
        "checks:\n  vanishing_grad:\n    patience: -1\n",
        ["checks.vanishing_grad.patience", ">= 1", "(got -1)"],
    ),
    "out-of-range-history": ("c.yaml", "history: 1000000\n", ["history", "100000"]),
    "top-level-list": ("c.yaml", "- a\n- b\n", ["top level must be a mapping", "list"]),
    "top-level-scalar": ("c.json", "42", ["top level must be a mapping", "int"]),
    "pyproject-table": (
        "pyproject.toml",
        '[tool.gradwatch]\nfail_fast = "perhaps"\n',
        ["fail_fast", "boolean", "'perhaps'"],
    ),
    "not-utf8": ("c.yaml", b"\xff\xfe\x00f", ["not a UTF-8 text file"]),
    "pickle": ("c.pkl", b"\x80\x04K\x01.", ["unsupported config format '.pkl'", ".yaml", ".json"]),
    "unsupported-ext": ("c.ini", "[x]\n", ["unsupported config format '.ini'"]),
}


def write(tmp_path: Path, name: str, content: Any) -> Path:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def assert_one_line(err: BaseException, path: Path, fragments: list[str]) -> None:
    text = str(err)
    assert isinstance(err, ConfigError)
    assert "\n" not in text, text
    assert text.startswith(f"{path}: "), text
    for fragment in fragments:
        # pydantic says "greater than or equal to 1"; accept either spelling of ">="
        alternatives = [fragment, fragment.replace(">= ", "greater than or equal to ")]
        assert any(a in text for a in alternatives), f"{fragment!r} not in {text!r}"
    # no chained traceback from the parser or pydantic
    assert err.__cause__ is None
    assert err.__context__ is None or err.__suppress_context__


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_file_from_file(case: str, tmp_path: Path) -> None:
    name, content, fragments = BAD_FILES[case]
    path = write(tmp_path, name, content)
    with pytest.raises(ConfigError) as err:
        GradWatchConfig.from_file(path)
    assert_one_line(err.value, path, fragments)


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_config_file_through_watch(case: str, tmp_path: Path) -> None:
    name, content, fragments = BAD_FILES[case]
    path = write(tmp_path, name, content)
    model = nn.Linear(2, 2)
    for arg in (path, str(path)):
        with pytest.raises(ConfigError) as err:
            gradwatch.watch(model, config=arg)
        assert_one_line(err.value, path, fragments)
    assert not model.weight._post_accumulate_grad_hooks


def test_several_problems_are_listed_on_the_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "every_n_steps: 0\nfail_on: fatal\ncolour: red\n")
    with pytest.raises(ConfigError) as err:
        GradWatchConfig.from_file(path)
    assert_one_line(err.value, path, ["every_n_steps", "fail_on", "unknown key 'colour'"])


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as err:
        GradWatchConfig.from_file(missing)
    assert_one_line(err.value, missing, ["cannot read config file", "No such file"])
    folder = tmp_path / "dir.yaml"
    folder.mkdir()
    with pytest.raises(ConfigError) as err:
        gradwatch.watch(nn.Linear(1, 1), config=folder)
    assert_one_line(err.value, folder, ["cannot read config file"])


def test_empty_file_is_the_default_config(tmp_path: Path) -> None:
    assert GradWatchConfig.from_file(write(tmp_path, "c.yaml", "")) == GradWatchConfig()


def test_good_files_in_every_format_load(tmp_path: Path) -> None:
    yaml = write(tmp_path, "c.yaml", "fail_on: warning\nchecks:\n  dead_param:\n    patience: 5\n")
    toml = write(tmp_path, "c.toml", 'fail_on = "warning"\n[checks.dead_param]\npatience = 5\n')
    json = write(
        tmp_path, "c.json", '{"fail_on": "warning", "checks": {"dead_param": {"patience": 5}}}'
    )
    pyproject = write(
        tmp_path,
        "pyproject.toml",
        '[tool.gradwatch]\nfail_on = "warning"\n[tool.gradwatch.checks.dead_param]\npatience = 5\n',
    )
    configs = [GradWatchConfig.from_file(p) for p in (yaml, toml, json, pyproject)]
    assert all(c == configs[0] for c in configs)
    assert configs[0].fail_on == "warning"
    assert configs[0].checks.dead_param.patience == 5


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:builtins.open [{target}, 'w']",
        "!!python/object/new:pathlib.Path [{target}]",
        "!!python/name:os.system",
        "fail_on: !!python/object/apply:builtins.open [{target}, 'w']",
    ],
)
def test_yaml_never_executes_code(tag: str, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    path = write(tmp_path, "c.yaml", tag.format(target=repr(str(target))) + "\n")
    with pytest.raises(ConfigError) as err:
        GradWatchConfig.from_file(path)
    assert_one_line(
        err.value, path, ["invalid YAML", "could not determine a constructor", "python/"]
    )
    assert not target.exists()


def test_bad_dict_config_names_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        gradwatch.watch(nn.Linear(1, 1), config={"checks": {"dead_param": {"patience": "x"}}})
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("config: checks.dead_param.patience:")


@pytest.mark.parametrize("value", [3.5, ["fail_on"], b"c.yaml", object()])
def test_config_of_the_wrong_kind(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^config must be a GradWatchConfig, a dict or a path"):
        gradwatch.watch(nn.Linear(1, 1), config=value)


# -- bad models and optimizers -----------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [None, "model", lambda x: x, torch.zeros(3), [nn.Linear(1, 1)]],
    ids=["None", "str", "function", "tensor", "list"],  # stable: parallel workers compare ids
)
def test_a_non_module_is_a_one_line_error(model: Any) -> None:
    with pytest.raises(ConfigError) as err:
        gradwatch.watch(model)
    text = str(err.value)
    assert text == (
        "watch() needs a torch.nn.Module or a dict of named modules "
        f"({{'G': netG, 'D': netD}}), got {type(model).__name__}"
    )


@pytest.mark.parametrize(
    "model",
    [nn.Linear(2, 2).requires_grad_(False), nn.ReLU(), nn.Sequential()],
    ids=["frozen", "parameterless", "empty"],
)
def test_a_model_without_trainable_parameters_is_a_one_line_error(model: nn.Module) -> None:
    with pytest.raises(ConfigError, match="has no trainable parameters") as err:
        with gradwatch.watch(model):
            pass
    assert "\n" not in str(err.value)
    assert type(model).__name__ in str(err.value)
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("optimizer", "culprit"),
    [
        (42, "not int"),
        ("sgd", "not str"),
        ({"lr": 0.1}, "optimizer 'lr' is a float"),  # a dict is named optimizers
        (nn.Linear(1, 1), "not Linear"),
        (torch.optim.SGD, "not type"),
        ([None], "optimizer[0] is a NoneType"),
        ((lambda: None,), "optimizer[0] is a function"),
    ],
    ids=["int", "str", "dict", "module", "class", "list-of-none", "tuple-of-function"],
)
def test_a_non_optimizer_is_a_one_line_error(optimizer: Any, culprit: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ConfigError) as err:
        gradwatch.watch(model, optimizer)
    text = str(err.value)
    assert "\n" not in text
    assert culprit in text
    assert "torch.optim.Optimizer" in text


def test_a_sequence_of_optimizers_is_accepted() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opts = (
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.SGD(model[1].parameters(), lr=0.1),
    )
    with gradwatch.watch(model, opts) as w:
        for opt in opts:
            opt.zero_grad()
        model(torch.randn(3, 2)).sum().backward()
        for opt in opts:
            opt.step()
    assert w.report().coverage.optimizers == 2
    assert w.report().findings == []


def test_a_frozen_model_beside_tensors_its_optimizer_trains_is_watched() -> None:
    """Temperature scaling (Guo et al. 2017): the classifier is frozen and the optimizer trains
    a temperature held outside it, on purpose: no ConfigError, and the run is judged."""
    model = nn.Linear(4, 3).requires_grad_(False)
    temperature = torch.ones(1, requires_grad=True)
    opt = torch.optim.Adam([temperature], lr=0.05)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with gradwatch.watch(model, opt, config={"warn": False}) as w:
        for _ in range(3):
            opt.zero_grad()
            with torch.no_grad():
                logits = model(x)
            nn.functional.cross_entropy(logits / temperature, y).backward()
            opt.step()
    report = w.report()
    assert report.steps == 3
    assert [f.line() for f in report.findings if f.severity != "info"] == []
    frozen_opt = torch.optim.SGD([nn.Parameter(torch.ones(1), requires_grad=False)], lr=0.1)
    with pytest.raises(ConfigError, match="has no trainable parameters"):
        gradwatch.watch(nn.Linear(2, 2).requires_grad_(False), frozen_opt).attach()
