"""MkDocs hook: the pages and tables that come from gradwatch itself, made at build time.

Nothing here is committed as generated text, so nothing can go stale:

- ``checks/index.md`` and one ``checks/<id>.md`` per documented check id, from the check
  registry (:func:`gradwatch.checks.explain.all_docs`), each check's ``Config`` and its source;
- ``<!-- gradwatch:config -->`` in a page: the reference of every ``GradWatchConfig`` field
  (type, default, description) from the pydantic model;
- ``<!-- gradwatch:cli -->``: each subcommand's ``--help``, from ``gradwatch.cli.build_parser``;
- ``<!-- gradwatch:readme TITLE -->``: the README section of that title (its ``#`` levels
  shifted; no title: the introduction), for what the README owns (what gradwatch finds,
  install, the shortest paths), so the site and the README say it once. Everything else
  lives in its page under ``docs/``; the README links there.

Every problem (a registered check without a doc, a README section a page includes that is
gone) is logged as a warning, which ``mkdocs build --strict`` turns into a failed build.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Optional

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.gradwatch")

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*gradwatch:(\w+)\s*(.*?)\s*-->")
CHECKS_NAV_TITLE = "Checks"


# -- the registry ---------------------------------------------------------------------------


def check_ids() -> list[str]:
    """Every id that gets a page: the registry's checks in order, then the CLI's ids."""
    from gradwatch.checks.explain import all_docs

    return list(all_docs())


def undocumented_checks() -> list[str]:
    """Registered checks without a ``doc``: they would have no page (a failed build)."""
    from gradwatch.checks.registry import ALL_CHECKS, SELF_CHECKS

    return [cls.id for cls in [*ALL_CHECKS, *SELF_CHECKS] if cls.doc is None]


def _configurable() -> dict[str, Any]:
    from gradwatch.config import ChecksConfig

    return dict(ChecksConfig.model_fields)


def _check_class(check_id: str) -> Optional[type]:
    from gradwatch.checks.registry import by_id

    try:
        return by_id(check_id)
    except KeyError:
        return None


def details_fields(check_id: str) -> list[str]:
    """The ``details`` keys a check's module writes (read from its source), then those its
    text names (``details.x``): what a finding of it can carry."""
    from gradwatch.checks.explain import lookup

    found: list[str] = []
    cls = _check_class(check_id)
    if cls is not None:
        source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
        found += _details_keys(ast.parse(source))
    doc = lookup(check_id)
    if doc is not None:
        text = " ".join([doc.summary, doc.why, *doc.causes, doc.fix, *doc.silence, doc.detail])
        found += re.findall(r"details\.(\w+)", text)
    return list(dict.fromkeys(found))


def _dict_keys(node: ast.AST) -> list[str]:
    if not isinstance(node, ast.Dict):
        return []
    return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]


def _is_details(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "details"


def _details_keys(tree: ast.AST) -> list[str]:
    keys: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "details":
            keys += _dict_keys(node.value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if _is_details(target) and node.value is not None:
                    keys += _dict_keys(node.value)
                elif isinstance(target, ast.Subscript) and _is_details(target.value):
                    index = target.slice
                    if isinstance(index, ast.Constant) and isinstance(index.value, str):
                        keys.append(index.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and _is_details(node.func.value)
        ):
            keys += [k.arg for k in node.keywords if k.arg is not None]
            for arg in node.args:
                keys += _dict_keys(arg)
    return keys


# -- the README -----------------------------------------------------------------------------


def readme() -> str:
    return (ROOT / "README.md").read_text(encoding="utf-8")


def readme_section(
    title: str,
    text: Optional[str] = None,
    *,
    page: str = "",
    titles: Optional[dict[str, str]] = None,
) -> Optional[str]:
    """The body of the README section headed ``title`` (any level, up to the next heading of
    its level or above; ``""``: the introduction before the first ``##``), its own
    subheadings shifted to start at ``###`` (the page gives the ``##``); ``None`` when it is
    gone.

    Links: ``docs/X.md`` becomes ``X.md`` (its text, when it is the path, the page's nav title
    from ``titles``), a link to another repository file keeps only its text, and a paragraph
    that begins "More in" and points at ``page`` itself (the page including it) is left out.
    """
    lines = (readme() if text is None else text).splitlines()
    fence = False
    level: Optional[int] = None
    out: list[str] = []
    for line in lines:
        if line.startswith("```"):
            fence = not fence
        heading = None if fence else re.match(r"(#+) (.*)", line)
        if heading and not title and level is None and heading[1] == "#":
            level = 2  # the introduction: from the H1 to the first "##"
            continue
        if heading and level is not None and len(heading[1]) <= level:
            break
        if heading and level is None and heading[2].strip() == title:
            level = len(heading[1])
        elif level is not None:
            out.append(line)
    if level is None:
        return None
    depths = [len(m[1]) for m in (re.match(r"(#+) ", ln) for ln in _outside_fences(out)) if m]
    shift = 3 - min(depths, default=3)
    body = "\n".join(
        "#" * (len(m[1]) + shift) + ln[len(m[1]) :] if m and not in_fence else ln
        for ln, in_fence, m in _with_fences(out)
    )
    return _site_links(_without_self_pointer(body, page), titles or {}).strip() + "\n"


def _without_self_pointer(body: str, page: str) -> str:
    """``body`` without its "More in [..](docs/PAGE)" paragraph when PAGE includes it."""
    if not page:
        return body
    paragraphs = re.split(r"\n\s*\n", body)
    target = re.compile(r"^More in \[[^\]]*\]\(docs/" + re.escape(page) + r"(#[^)]*)?\)")
    return "\n\n".join(p for p in paragraphs if not target.match(p.strip()))


def _site_links(body: str, titles: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        label, target = match[1], match[2]
        if target.startswith(("http:", "https:", "#")):
            return match[0]
        if target.startswith("docs/"):
            path = target[len("docs/") :]
            name = path.split("#")[0]
            if label in (target, name, f"`{target}`"):
                label = titles.get(name, label)
            return f"[{label}]({path})"
        return label  # a repository file has no page here: keep the text

    return re.sub(r"\[([^\]]+)\]\(([^)]+)\)", one, body)


def _with_fences(lines: list[str]) -> list[tuple[str, bool, Optional[re.Match[str]]]]:
    """Each line, whether it is inside (or opens/closes) a code fence, and its heading match."""
    out: list[tuple[str, bool, Optional[re.Match[str]]]] = []
    fence = False
    for line in lines:
        if line.startswith("```"):
            fence = not fence
            out.append((line, True, None))
        else:
            out.append((line, fence, None if fence else re.match(r"(#+) ", line)))
    return out


def _outside_fences(lines: list[str]) -> list[str]:
    return [line for line, in_fence, _ in _with_fences(lines) if not in_fence]


# -- page text ------------------------------------------------------------------------------


def md(text: str) -> str:
    """A check's plain text as markdown: outside `code`, ``__init__`` stays a name, not bold,
    and ``*`` and ``<`` stay characters."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("__", r"\_\_").replace("*", r"\*").replace("<", "&lt;")
    return "".join(parts)


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        if hasattr(value, "model_dump"):
            return "see below"
    else:
        value = field.default
    return "`" + json.dumps(value if not isinstance(value, Path) else str(value)) + "`"


def _type(schema: dict[str, Any]) -> str:
    if "anyOf" in schema:
        return " or ".join(_type(s) for s in schema["anyOf"])
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type", "object")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    bounds = [f"≥ {schema['minimum']}"] if "minimum" in schema else []
    bounds += [f"≤ {schema['maximum']}"] if "maximum" in schema else []
    bounds += [f"> {schema['exclusiveMinimum']}"] if "exclusiveMinimum" in schema else []
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def fields_table(model: Any, *, notes: Optional[dict[str, str]] = None) -> str:
    """One row per field of a pydantic model: key, type, default, description (or the note
    given for it)."""
    props = model.model_json_schema()["properties"]
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        desc = (notes or {}).get(name) or md(field.description or "")
        prop = props.get(name, {})
        desc = desc.replace("|", "\\|")
        rows.append(f"| `{name}` | {_type(prop)} | {_default(field)} | {desc} |")
    return "\n".join(rows) + "\n"


def config_reference() -> str:
    from gradwatch.config import GradWatchConfig

    checks = ", ".join(f"[`{i}`](checks/{i}.md#settings)" for i in _configurable())
    note = "One entry per check id, each with `enabled`, `severity` and its own thresholds."
    return (
        fields_table(GradWatchConfig, notes={"checks": note})
        + f"\n`checks.<id>`: the settings are on each check's page: {checks}.\n"
    )


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """``gradwatch --help`` and each subcommand's ``--help``, as wide as a page's code block."""
    from gradwatch.cli.main import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        parser = build_parser()
        parts = ["## `gradwatch`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subparsers(parser).items():
            parts += [f"## `gradwatch {name}`", "", "```text", sub.format_help().rstrip(), "```"]
            parts.append("")
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def cli_has_option(command: str, option: str) -> bool:
    from gradwatch.cli.main import build_parser

    sub = _subparsers(build_parser()).get(command)
    return sub is not None and any(option in a.option_strings for a in sub._actions)


def _silencing(check_id: str, doc: Any) -> list[str]:
    if check_id not in _configurable():
        own = _check_class(check_id) is not None
        return [
            "It is gradwatch's own and always on: it has no `checks` entry."
            if own
            else "It comes from the command line, not from a check: it has no `checks` entry.",
            "",
            *[f"- {md(way)}" for way in doc.silence or ("It cannot be turned off.",)],
        ]
    out = [
        "Turn it off in the config:",
        "",
        "```yaml",
        f"checks:\n  {check_id}:\n    enabled: false",
        "```",
        "",
    ]
    if cli_has_option("check", "--ignore-check"):
        out += ["or on the command line:", "", "```console"]
        out += [f"$ gradwatch check ci/probe.py:build --ignore-check {check_id}", "```", ""]
    out += ["Other ways:", "", *[f"- {md(way)}" for way in doc.silencing(check_id)]]
    return out


def check_page(check_id: str) -> str:
    """The page of one check id."""
    from gradwatch.checks.explain import default_severity, lookup, maturity_text

    doc = lookup(check_id)
    assert doc is not None, check_id
    cls = _check_class(check_id)
    lines = [f"# `{check_id}`", "", f"**Default severity:** `{default_severity(check_id)}`"]
    stage = maturity_text(check_id)
    if stage:  # "Maturity: preview. ..." as a bold label and its sentence
        label, _, said = stage.partition(": ")
        lines += ["", f"**{label}:** {md(said)}"]
    if cls is not None:
        lines += ["", f"**Check class:** `{cls.__module__}.{cls.__qualname__}`"]
    lines += ["", "## What fires it", "", md(doc.summary), ""]
    if doc.detail:
        lines += [f"In detail: {md(doc.detail).rstrip('.')}.", ""]
    lines += ["## Why it matters", "", md(doc.why), "", "## Common causes", ""]
    lines += [f"- {md(cause)}" for cause in doc.causes]
    lines += ["", "## How to fix it", "", md(doc.fix), "", "## Details fields", ""]
    fields = details_fields(check_id)
    if fields:
        lines += [
            "A finding of this check can carry these keys in `details` (JSON report, "
            "`finding.details`):",
            "",
            ", ".join(f"`{f}`" for f in fields),
        ]
    else:
        lines.append("This check writes no `details` of its own.")
    lines += ["", "## Settings", ""]
    cfg = _configurable().get(check_id)
    if cfg is not None:
        lines += [f"Under `checks.{check_id}` in the config:", ""]
        lines.append(fields_table(cfg.annotation))
    else:
        lines += ["None: it has no entry under `checks` in the config.", ""]
    lines += ["## How to silence it", "", *_silencing(check_id, doc), ""]
    lines += ["## From the command line", "", "```console", f"$ gradwatch explain {check_id}"]
    lines += ["```", "", "[All checks](index.md)", ""]
    return "\n".join(lines)


def checks_index() -> str:
    from gradwatch.checks.explain import all_docs, default_severity, maturity

    lines = [
        "# Checks",
        "",
        "Every id a finding can carry, generated from the check registry. Each page says what "
        "fires the check, why it matters, its causes, how to fix it, its settings and how to "
        "silence it; `gradwatch explain ID` prints its summary, causes, fix and how to silence it. Which checks run at every "
        "step and which on observed steps: [When the checks run](../watch.md#when-the-checks-run).",
        "",
        "| id | default severity | maturity | fires when |",
        "|---|---|---|---|",
    ]
    for check_id, doc in all_docs().items():
        summary = md(doc.summary).replace("|", "\\|")
        sev = default_severity(check_id)
        stage = maturity(check_id) or "-"
        lines.append(f"| [`{check_id}`]({check_id}.md) | `{sev}` | {stage} | {summary} |")
    return "\n".join(lines) + "\n"


def expand(markdown: str, page_path: str, titles: Optional[dict[str, str]] = None) -> str:
    """Replace every ``<!-- gradwatch:... -->`` marker of one page."""

    def one(match: re.Match[str]) -> str:
        kind, arg = match[1], match[2]
        if kind == "config":
            return config_reference()
        if kind == "cli":
            return cli_reference()
        if kind == "readme":
            section = readme_section(arg, page=page_path, titles=titles)
            if section is None:
                log.warning(f"{page_path}: README.md has no section {arg!r} to include")
                return ""
            return section
        log.warning(f"{page_path}: unknown marker gradwatch:{kind}")
        return ""

    return MARKER.sub(one, markdown)


def problems() -> list[str]:
    """What makes the checks' pages untrue: each item fails a strict build."""
    return [f"check {i!r} has no doc, so no page" for i in undocumented_checks()]


# -- mkdocs events --------------------------------------------------------------------------


def on_config(config: Any) -> Any:
    """Put one nav entry per check page under the nav's "Checks" entry."""
    pages = [{check_id: f"checks/{check_id}.md"} for check_id in check_ids()]
    for i, item in enumerate(config["nav"] or []):
        if isinstance(item, dict) and CHECKS_NAV_TITLE in item:
            config["nav"][i] = {CHECKS_NAV_TITLE: [{"All checks": "checks/index.md"}, *pages]}
    return config


def on_files(files: Any, config: Any) -> Any:
    for problem in problems():
        log.warning(problem)
    files.append(File.generated(config, "checks/index.md", content=checks_index()))
    for check_id in check_ids():
        files.append(File.generated(config, f"checks/{check_id}.md", content=check_page(check_id)))
    return files


def nav_titles(nav: Any) -> dict[str, str]:
    """Each page's path -> its nav title (``mkdocs.yml``'s ``nav``)."""
    out: dict[str, str] = {}
    for item in nav or []:
        if isinstance(item, dict):
            for title, value in item.items():
                if isinstance(value, str):
                    out[value] = title
                else:
                    out.update(nav_titles(value))
    return out


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return expand(markdown, page.file.src_uri, nav_titles(config["nav"]))


if __name__ == "__main__":
    # A look at one generated page: python docs/hooks/pages.py [ID]
    import sys

    print(check_page(sys.argv[1]) if len(sys.argv) > 1 else checks_index())
