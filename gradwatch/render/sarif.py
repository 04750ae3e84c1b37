"""A report as SARIF 2.1.0, the format GitHub code scanning and other CI tools read.

One ``run`` whose tool ``gradwatch`` has one rule per check id (the enabled checks and any id
in the findings, with the ``gradwatch explain`` text as help) and one result per finding.
A result points at the source line that created the layer (``details.defined_at``) and,
as a related location, the line that called it (``details.called_at``); a finding without
a known line has a logical location (the module name) only. Paths relative to the current
directory use the ``%SRCROOT%`` base.

Example:
    >>> write_sarif(watcher.report(), "gradwatch.sarif")  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any, Optional, Union
from urllib.parse import quote

from gradwatch._text import clip, safe
from gradwatch._version import __version__
from gradwatch.render.junit import check_ids
from gradwatch.results import Finding, ReportData

__all__ = ["SARIF_SCHEMA", "SARIF_VERSION", "sarif_log", "write_sarif"]

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_LEVEL = {"error": "error", "warning": "warning", "info": "note"}


def _rule(check: str) -> dict[str, Any]:
    from gradwatch.checks.explain import default_severity, explain_text, lookup, maturity

    doc = lookup(check)
    rule: dict[str, Any] = {
        "id": check,
        "name": "".join(part.capitalize() for part in check.split("_")),
    }
    if doc is not None:
        rule["shortDescription"] = {"text": doc.summary}
        rule["fullDescription"] = {"text": doc.why}
        rule["help"] = {"text": explain_text(check) or doc.summary}
        level = _LEVEL.get(default_severity(check) or "", "warning")
        rule["defaultConfiguration"] = {"level": level}
    else:
        rule["shortDescription"] = {"text": safe(check)}
    stage = maturity(check)
    rule["properties"] = {"tags": ["gradwatch", "training", *([stage] if stage else [])]}
    if stage:
        rule["properties"]["maturity"] = stage
    return rule


def _physical(location: str, text: str) -> Optional[dict[str, Any]]:
    path, sep, line = location.rpartition(":")
    if not sep or not path or not line.isdigit() or int(line) < 1:
        return None
    if os.path.isabs(path):
        artifact = {"uri": Path(path).as_uri()}
    elif os.path.normpath(path).split(os.sep)[0] == os.pardir:
        return None  # `../../etc/passwd` (a report read from anywhere): outside the source root
    else:
        artifact = {
            "uri": quote(PurePosixPath(*Path(path).parts).as_posix()),
            "uriBaseId": "%SRCROOT%",
        }
    return {
        "physicalLocation": {"artifactLocation": artifact, "region": {"startLine": int(line)}},
        "message": {"text": text},
    }


def _result(f: Finding, rule_index: int, baseline: bool) -> dict[str, Any]:
    text = clip(safe(f.message)) + (f" Hint: {clip(safe(f.hint))}" if f.hint else "")
    if f.preview():
        text = "(preview) " + text
    result: dict[str, Any] = {
        "ruleId": f.check,
        "ruleIndex": rule_index,
        "level": _LEVEL[f.severity],
        "message": {"text": text},
    }
    logical = (
        [{"name": safe(f.module), "fullyQualifiedName": safe(f.module), "kind": "module"}]
        if f.module
        else []
    )
    found = [
        (key, _physical(str(f.details[key]), label))
        for key, label in (("defined_at", "layer created here"), ("called_at", "called here"))
        if f.details.get(key)
    ]
    places = [place for _, place in found if place is not None]
    if places:
        primary = dict(places[0])
        if logical:
            primary["logicalLocations"] = logical
        result["locations"] = [primary]
        if len(places) > 1:
            result["relatedLocations"] = [{"id": k, **p} for k, p in enumerate(places[1:])]
    elif logical:
        result["locations"] = [{"logicalLocations": logical}]
    digest = hashlib.sha256("\x00".join(f.key()).encode("utf-8", "surrogatepass")).hexdigest()
    result["partialFingerprints"] = {"gradwatchFinding/v1": digest}
    if baseline:
        result["baselineState"] = "unchanged" if f.baselined() else "new"
    result["properties"] = {
        "params": [safe(p) for p in f.params],
        "cause": safe(f.cause()),
        "firstStep": f.first_step,
        "lastStep": f.last_step,
        "count": f.count,
    }
    if f.preview():
        result["properties"]["maturity"] = "preview"
    return result


def sarif_log(report: ReportData, *, extra_checks: Iterable[str] = ()) -> dict[str, Any]:
    """The SARIF 2.1.0 log of ``report`` as a JSON-ready dict.

    Args:
        report: the report to convert.
        extra_checks: more check ids to list as rules even without findings.

    Example:
        >>> log = sarif_log(report)  # doctest: +SKIP
        >>> log["version"]  # doctest: +SKIP
        '2.1.0'
    """
    ids = check_ids(report, extra_checks)
    index = {check: k for k, check in enumerate(ids)}
    baseline = any(f.baselined() for f in report.findings)
    results = [_result(f, index[f.check], baseline) for f in report.findings]
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "gradwatch",
                "version": report.gradwatch_version or __version__,
                "rules": [_rule(check) for check in ids],
            }
        },
        "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().as_uri().rstrip("/") + "/"}},
        "invocations": [{"executionSuccessful": True}],
        "results": results,
        "properties": {
            "failed": report.failed,
            "failOn": report.fail_on,
            "steps": report.steps,
            "torchVersion": report.torch_version,
        },
    }
    return {"$schema": SARIF_SCHEMA, "version": SARIF_VERSION, "runs": [run]}


def write_sarif(
    report: ReportData, path: Union[str, Path], *, extra_checks: Iterable[str] = ()
) -> Path:
    """Write :func:`sarif_log` as JSON to ``path`` atomically (parent folders created).

    As :meth:`gradwatch.Report.write`: a symlink's target is updated, a non-regular file is refused
    (``ConfigError``), a failed write leaves the old file whole. Returns ``path``.
    """
    from gradwatch.report_io import write_text_atomic

    text = json.dumps(sarif_log(report, extra_checks=extra_checks), indent=2)
    return write_text_atomic(path, text + "\n", what="SARIF")
