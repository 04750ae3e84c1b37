"""The documentation site builds with warnings as errors, and says what the code does.

``mkdocs build --strict`` runs here (CI runs the tests), with the hook that generates the
checks' pages, the config reference and the CLI reference (``docs/hooks/pages.py``). A broken
link or a README section a page includes that is gone fails the build; a registered check
without a doc would have no page. The checks' pages come from the registry alone (nothing in
the README lists checks), and the README stays the short way in: under 400 lines, the two
commands, links to the pages that hold the rest.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gradwatch.checks.explain import all_docs, default_severity, maturity
from gradwatch.checks.registry import ALL_CHECKS
from gradwatch.cli.main import build_parser
from gradwatch.config import GradWatchConfig

ROOT = Path(__file__).resolve().parents[2]


def _build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", site],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gradwatch_docs_pages", ROOT / "docs/hooks/pages.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(text: str | None) -> str:
    """Markdown source as the page shows it: code spans lose their backticks."""
    return (text or "").replace("`", "")


def _text(path: Path) -> str:
    """A built page's text, tags stripped (a highlighted code block is its characters)."""
    body = path.read_text()
    body = body[body.index('<article class="md-content__inner') :]
    return html.unescape(re.sub(r"<[^>]+>", "", body))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs") / "site"
    done = _build(ROOT, out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_every_documented_id_has_a_page_linked_from_the_checks_index(site: Path) -> None:
    index = (site / "checks/index.html").read_text()
    for check_id, doc in all_docs().items():
        assert f'href="{check_id}/"' in index, check_id
        page = _text(site / f"checks/{check_id}/index.html")
        assert f"Default severity: {default_severity(check_id)}" in page, check_id
        stage = maturity(check_id)
        assert stage is None or f"Maturity: {stage}." in page, check_id
        for cause in doc.causes:
            assert _plain(cause) in page, (check_id, cause)
        assert _plain(doc.fix) in page, check_id
        assert _plain(doc.detail.rstrip(".")) in page, check_id  # "" when it has none
    for cls in ALL_CHECKS:  # a configurable check: its settings and how to turn it off
        page = _text(site / f"checks/{cls.id}/index.html")
        assert f"checks:\n  {cls.id}:\n    enabled: false" in page, cls.id
        for name, field in cls.Config.model_fields.items():
            assert f"\n{name}\n" in page and _plain(field.description) in page, (cls.id, name)


def test_config_and_cli_references_cover_every_field_and_option(site: Path) -> None:
    config = _text(site / "configuration/index.html")
    for name, field in GradWatchConfig.model_fields.items():
        assert f"\n{name}\n" in config, name
        assert _plain(field.description) in config, name
    cli = _text(site / "cli/index.html")
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for command, sub in commands.choices.items():
        assert f"usage: gradwatch {command}" in cli, command
        for action in sub._actions:
            for option in action.option_strings:
                assert option in cli, (command, option)


@pytest.mark.slow  # a second whole build
def test_strict_build_fails_on_a_broken_link_and_a_lost_readme_section(tmp_path: Path) -> None:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    page = tmp_path / "docs/index.md"
    page.write_text(
        page.read_text() + "\nSee [a check that is not there](checks/no_such_check.md).\n"
    )
    readme = (ROOT / "README.md").read_text()
    assert "\n### PyTorch Lightning\n" in readme
    readme = readme.replace("\n### PyTorch Lightning\n", "\n### Lightning, renamed\n")
    (tmp_path / "README.md").write_text(readme)

    done = _build(tmp_path, tmp_path / "site")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "checks/no_such_check.md" in out
    assert "no section 'PyTorch Lightning'" in out


def test_the_checks_pages_need_nothing_from_the_readme(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check added without a word in the README gets its whole page: the registry is the one
    source (the README's checks table is gone; rows that come back in a merge are unread)."""
    hook = _hook()
    monkeypatch.setattr(hook, "readme", lambda: "# gradwatch\n")
    assert hook.problems() == []
    details = 0
    for cls in ALL_CHECKS:
        page = hook.check_page(cls.id)
        assert cls.doc is not None
        if cls.doc.detail:  # optional: a check's full account, when its summary is not enough
            details += 1
            assert f"In detail: {hook.md(cls.doc.detail).rstrip('.')}." in page, cls.id
    assert details > len(ALL_CHECKS) // 2  # the former README rows did move there
    assert "| `ghost_param` |" not in (ROOT / "README.md").read_text()


def test_the_readme_is_short_names_the_two_commands_and_links_real_pages() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 400
    assert "bash .ci/demo" in readme and "bash .ci/test" in readme
    assert "exec bash .ci/test" in (ROOT / ".ci/run").read_text()  # CI runs the README's command
    links = re.findall(r"\]\(((?!https?:|#)[^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    for target in links:
        assert (ROOT / target).is_file(), target
    titles = _hook().nav_titles(_nav())
    for target in links:  # a docs page the README links is on the site
        if target.startswith("docs/"):
            assert target[len("docs/") :] in titles, target
    for path in titles:  # and every page of the site is linked from the README
        if path != "index.md" and (ROOT / "docs" / path).is_file():
            assert f"docs/{path}" in links, path


def test_each_page_including_a_readme_section_finds_it() -> None:
    hook = _hook()
    titles = hook.nav_titles(_nav())
    for path in titles:
        source = ROOT / "docs" / path
        if not source.is_file():
            continue  # generated (the checks' pages)
        for kind, title in hook.MARKER.findall(source.read_text()):
            if kind == "readme":
                section = hook.readme_section(title, page=path, titles=titles)
                assert section, (path, title)
                assert f"]({path})" not in section  # its own "More in" pointer is left out


def _nav() -> list[object]:
    import yaml

    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]  # type: ignore[no-any-return]


def test_a_registered_check_without_a_doc_is_a_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    hook = _hook()
    assert hook.problems() == []
    cls = ALL_CHECKS[-1]
    monkeypatch.setattr(cls, "doc", None)
    assert f"check {cls.id!r} has no doc, so no page" in hook.problems()
