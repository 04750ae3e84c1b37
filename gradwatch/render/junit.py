"""A report as JUnit XML: one ``testcase`` per check, failed when its findings reach ``fail_on``.

CI systems (GitHub Actions test reporters, GitLab, Jenkins) read this format. The tree is
``<testsuites><testsuite name="gradwatch">``, one ``<testcase classname="gradwatch"
name="<check id>">`` per enabled check plus any other check id present in the findings; a
case carries ``<failure>`` with its failing findings, and findings below ``fail_on`` go to
its ``<system-out>``.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from pathlib import Path
from typing import Optional, Union

from gradwatch._severity import at_least
from gradwatch._text import clip, safe
from gradwatch.results import Finding, ReportData

__all__ = ["check_ids", "finding_text", "junit_xml", "write_junit"]

SUITE = "gradwatch"

# Characters XML 1.0 cannot carry, even escaped (a NaN message never holds them, a user's
# parameter name or exception text might).
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _clean(text: str) -> str:
    return _INVALID_XML.sub("?", text)


def finding_text(f: Finding) -> str:
    """A finding as a few indented lines: message, parameters, cause, source lines, steps, hint."""
    lines = [f"[{f.severity_label()}] {clip(f.message)}"]
    if f.params:
        lines.append("  parameters: " + ", ".join(f.params))
    elif f.module:
        lines.append(f"  module: {f.module}")
    cause = f.details.get("cause") or f.details.get("origin")
    if cause:
        lines.append(f"  cause: {cause}")
    for key, label in (("defined_at", "defined at"), ("called_at", "called at")):
        if f.details.get(key):
            lines.append(f"  {label}: {f.details[key]}")
    lines.append(f"  steps: {f.first_step}..{f.last_step} (seen {f.count}x)")
    if f.hint:
        lines.append(f"  hint: {clip(f.hint)}")
    return "\n".join(safe(line) for line in lines)  # names are untrusted: no raw escapes


def check_ids(report: ReportData, extra: Iterable[str] = ()) -> list[str]:
    """Enabled check ids of the report's config, then ``extra``, then ids only in findings."""
    checks = report.config.checks
    ids = [name for name in type(checks).model_fields if getattr(checks, name).enabled]
    for name in [*extra, *(f.check for f in report.findings)]:
        if name not in ids:
            ids.append(name)
    return ids


def _element(report: ReportData, extra: Iterable[str], time: Optional[float]) -> ET.Element:
    ids = check_ids(report, extra)
    root = ET.Element("testsuites", name=SUITE)
    suite = ET.SubElement(root, "testsuite", name=SUITE)
    props = ET.SubElement(suite, "properties")
    for key, value in (
        ("gradwatch_version", report.gradwatch_version),
        ("torch_version", report.torch_version),
        ("fail_on", report.fail_on),
        ("steps", str(report.steps)),
        ("backward_passes", str(report.backward_passes)),
    ):
        ET.SubElement(props, "property", name=key, value=_clean(value))
    failures = 0
    for check in ids:
        found = report.by_check(check)
        failing = [f for f in found if at_least(f.severity, report.fail_on)]
        case = ET.SubElement(suite, "testcase", classname=SUITE, name=check)
        case.set("time", "0")
        if failing:
            failures += 1
            first = failing[0]
            message = (
                first.line()
                if len(failing) == 1
                else (f"{len(failing)} findings; first: {first.line()}")
            )
            failure = ET.SubElement(
                case, "failure", message=_clean(clip(message)), type=f"{check}.{first.severity}"
            )
            failure.text = _clean("\n\n".join(finding_text(f) for f in failing))
        quiet = [f for f in found if not at_least(f.severity, report.fail_on)]
        if quiet:
            out = ET.SubElement(case, "system-out")
            out.text = _clean("\n\n".join(finding_text(f) for f in quiet))
    totals = {
        "tests": str(len(ids)),
        "failures": str(failures),
        "errors": "0",
        "skipped": "0",
        "time": f"{time or 0.0:.3f}",
    }
    for element in (root, suite):
        for key, value in totals.items():
            element.set(key, value)
    return root


def junit_xml(
    report: ReportData, *, extra_checks: Iterable[str] = (), time: Optional[float] = None
) -> str:
    """The JUnit XML document (with its XML declaration) for ``report``.

    Args:
        report: the report to render.
        extra_checks: more check ids to list as test cases even without findings (e.g. the
            CLI's ``loss_not_decreasing`` when ``--overfit`` ran).
        time: seconds the run took, for the suite's ``time`` attribute.

    Example:
        >>> xml = junit_xml(watcher.report())  # doctest: +SKIP
        >>> xml.startswith("<?xml")  # doctest: +SKIP
        True
    """
    root = _element(report, extra_checks, time)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write_junit(
    report: ReportData,
    path: Union[str, Path],
    *,
    extra_checks: Iterable[str] = (),
    time: Optional[float] = None,
) -> Path:
    """Write :func:`junit_xml` to ``path`` atomically (parent folders created); return the path.

    As :meth:`gradwatch.Report.write`: a symlink's target is updated, a non-regular file is refused
    (``ConfigError``), a failed write leaves the old file whole.
    """
    from gradwatch.report_io import write_text_atomic

    xml = junit_xml(report, extra_checks=extra_checks, time=time)
    return write_text_atomic(path, xml, what="JUnit XML")
