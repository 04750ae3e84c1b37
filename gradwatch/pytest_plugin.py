"""pytest plugin: a ``gradwatch`` fixture that fails a test whose training steps have findings.

Loaded through the ``pytest11`` entry point whenever gradwatch is installed. Its own
imports of gradwatch's modules wait until a test uses the fixture or an option is given.

Example:
    >>> def test_model_trains(gradwatch):  # doctest: +SKIP
    ...     model, opt = MyNet(), torch.optim.SGD(...)
    ...     gradwatch(model, opt, config={"ignore": ["aux_head.*"]})
    ...     for x, y in batches[:3]:
    ...         opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    ... # the test fails after its body when gradwatch's report fails

Options (group ``gradwatch``): ``--gradwatch-config FILE`` (a base config for every
fixture; a test's own ``config`` is merged over it and ``ignore`` lists add up),
``--gradwatch-fail-on LEVEL`` (beats both), ``--gradwatch-report-dir DIR`` (one JSON
report per test, named from its node id), ``--gradwatch-no-probes`` (skip the probes that
``gradwatch(model, opt, batch=..., loss_fn=...)`` runs on copies of the model first).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import pytest

if TYPE_CHECKING:
    from gradwatch.config import GradWatchConfig
    from gradwatch.core.watcher import Watcher

__all__ = ["gradwatch", "report_filename"]

_WATCHERS = pytest.StashKey[list]()
_BASE = pytest.StashKey[dict]()
_PROBED = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register the ``--gradwatch-*`` options."""
    group = parser.getgroup("gradwatch", "gradwatch: silent training bugs")
    group.addoption(
        "--gradwatch-config",
        metavar="FILE",
        default=None,
        help="gradwatch config file (.yaml/.toml/.json) for every `gradwatch` fixture; a "
        "test's own config is merged over it.",
    )
    group.addoption(
        "--gradwatch-report-dir",
        metavar="DIR",
        default=None,
        help="write one gradwatch JSON report per test using the fixture into DIR.",
    )
    group.addoption(
        "--gradwatch-fail-on",
        choices=["info", "warning", "error", "never"],
        default=None,
        help="fail tests on findings at/above this severity (overrides every config).",
    )
    group.addoption(
        "--gradwatch-no-probes",
        action="store_true",
        default=False,
        help="skip the probes (gradient check, sample dependence, overfit one batch) that a "
        "fixture given batch= and loss_fn= runs on copies of the model.",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Load ``--gradwatch-config`` once, failing the run with one line when it is bad."""
    path = config.getoption("gradwatch_config", None)
    if not path:
        return
    from gradwatch.config import GradWatchConfig
    from gradwatch.errors import ConfigError

    try:
        base = GradWatchConfig.from_file(path)
    except ConfigError as exc:
        raise pytest.UsageError(f"--gradwatch-config: {exc}") from None
    config.stash[_BASE] = base.model_dump(exclude_unset=True)


def _as_dict(value: Any) -> dict[str, Any]:
    from gradwatch.config import GradWatchConfig

    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    return GradWatchConfig.coerce(value).model_dump(exclude_unset=True)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if key == "ignore" and isinstance(value, list):
            old = list(out.get("ignore", []))
            out["ignore"] = old + [p for p in value if p not in old]
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def effective_config(pytest_config: pytest.Config, config: Any = None) -> GradWatchConfig:
    """The fixture's config: ``--gradwatch-config``, the test's ``config`` over it, then
    ``--gradwatch-fail-on``; statistics on every step and no warnings unless set."""
    from gradwatch.cli.probe import resolve_config

    merged = _merge(pytest_config.stash.get(_BASE, {}), _as_dict(config))
    return resolve_config(
        merged, fail_on=pytest_config.getoption("gradwatch_fail_on", None), warn=False
    )


@pytest.fixture
def gradwatch(request: pytest.FixtureRequest) -> Generator[Callable[..., Watcher], None, None]:
    """Start a watcher: ``w = gradwatch(model, optimizer=None, config=None)``.

    The watcher is already entered; run a few ordinary training steps. After the test body
    every watcher is closed and the test fails (``pytest.fail``) when a report fails, listing
    the findings (check, parameters, cause, hint). Several watchers per test are fine.
    Given ``batch=`` and ``loss_fn=`` (``loss_fn(model, batch) -> Tensor``), the probes
    (:func:`gradwatch.probe`) run first on copies of the model, and their findings fail the
    test too (``--gradwatch-no-probes`` skips them).

    Example:
        >>> def test_no_ghosts(gradwatch):  # doctest: +SKIP
        ...     gradwatch(model, opt)
        ...     train_steps(model, opt, 2)
    """
    from gradwatch.core.watcher import watch
    from gradwatch.probes import probe

    watchers: list[Watcher] = []
    request.node.stash[_WATCHERS] = watchers
    probed: list[Any] = []
    request.node.stash[_PROBED] = probed

    def start(
        model: Any,
        optimizer: Any = None,
        config: Any = None,
        *,
        scaler: Any = None,
        batch: Any = None,
        loss_fn: Any = None,
    ) -> Watcher:
        cfg = effective_config(request.config, config)
        skip = request.config.getoption("gradwatch_no_probes", False)
        if skip or (batch is not None and loss_fn is not None):
            # no probes asked for, or the loss-based ones below cover watch()'s loss-free ones
            cfg = cfg.model_copy(update={"probes": "off"})
        if batch is not None and loss_fn is not None:
            if not skip:
                first = optimizer[0] if isinstance(optimizer, (list, tuple)) else optimizer
                probed.append(probe(model, batch, loss_fn, first, config=cfg))
        watcher = watch(model, optimizer, config=cfg, scaler=scaler)
        watcher.__enter__()
        watchers.append(watcher)
        return watcher

    yield start
    for w in watchers:
        w.close()
    folder = request.config.getoption("gradwatch_report_dir", None)
    if folder:
        for k, w in enumerate(watchers):
            w.report().write(Path(folder) / report_filename(request.node.nodeid, k))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    """After a test body that passed, close its watchers and fail it on their findings."""
    result = yield
    watchers: Optional[list[Watcher]] = item.stash.get(_WATCHERS, None)
    if watchers:
        for w in watchers:
            w.close()
        probed: list[Any] = item.stash.get(_PROBED, [])
        message = failure_message(watchers, probed)
        if message:
            pytest.fail(message, pytrace=False)
    return result


def failure_message(watchers: list[Watcher], probed: Sequence[Any] = ()) -> str:
    """The findings of every failing report (the probes' too), or ``""`` when none failed."""
    from gradwatch.render.junit import finding_text

    parts = []
    reports = [(w.report(), "watcher") for w in watchers] + [(r, "probes") for r in probed]
    for k, (report, kind) in enumerate(reports):
        if not report.failed:
            continue
        failing = report.failing()
        if kind == "probes":
            which = " (probes, on a copy of the model)"
        else:
            which = f" (watcher {k + 1} of {len(watchers)})" if len(watchers) > 1 else ""
        parts.append(
            f"gradwatch{which}: {len(failing)} finding(s) at or above fail_on={report.fail_on!r}:\n"
            + "\n".join(f"- {f.check}: " + finding_text(f).replace("\n", "\n  ") for f in failing)
        )
    return "\n\n".join(parts)


def report_filename(nodeid: str, index: int = 0) -> str:
    """A file name for a test's report: the node id with unsafe characters replaced.

    A node id that needed any replacement (beyond ``::``) gets a short hash of the id, so
    ``test_p[a/b]`` and ``test_p[a_b]`` never share a file.

    Example:
        >>> report_filename("test_a.py::test_b")
        'test_a.py__test_b.json'
        >>> report_filename("tests/test_a.py::test_b[x/1]")
        'tests_test_a.py__test_b_x_1-221caedca9fe.json'
    """
    plain = nodeid.replace("::", "__")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", plain).strip("._") or "test"
    digest = hashlib.sha1(nodeid.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    if len(name) > 120:  # keep under file-system limits, unique through a hash of the full id
        name = name[:100] + "-" + digest
    elif name != plain or "__" in nodeid:  # characters replaced: two ids may have met
        name = f"{name}-{digest}"
    suffix = f"-{index + 1}" if index else ""
    return f"{name}{suffix}.json"
