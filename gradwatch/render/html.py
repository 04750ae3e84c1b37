"""A self-contained HTML report: summary, findings, charts and coverage in one offline file.

Charts are PNGs inlined as ``data:`` URIs (see :mod:`gradwatch.render.html_plots`); the page loads
nothing from the network and runs no script.

Example:
    >>> report = gradwatch.Report.read("gradwatch-report.json")  # doctest: +SKIP
    >>> report.to_html("report.html")  # doctest: +SKIP
    PosixPath('report.html')
"""

from __future__ import annotations

import html
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from gradwatch._text import clip, name, safe
from gradwatch.checks.registry import ALL_CHECKS
from gradwatch.errors import ConfigError
from gradwatch.render.diagnostics import spike_layers

if TYPE_CHECKING:
    from gradwatch.results import Finding, ReportData

__all__ = ["MissingExtraError", "notebook_html", "render_html", "write_html"]

log = logging.getLogger("gradwatch")

_PARAMS_SHOWN = 6
# Checks a config can turn off (gradwatch's own, internal_error and the like, are always on).
_SILENCEABLE = frozenset(cls.id for cls in ALL_CHECKS)
_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:24px auto;
 max-width:1200px;padding:0 16px;color:#1d1d1f;background:#fff}
h1{font-size:1.6em;margin:0 0 4px}h2{font-size:1.2em;margin:28px 0 8px;border-bottom:1px solid #ddd}
.status{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:600}
.failed{background:#c62828}.passed{background:#2e7d32}
.meta{color:#555;font-size:.9em}
table{border-collapse:collapse;width:100%;font-size:.88em}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
td{overflow-wrap:break-word}table.findings{table-layout:fixed}
th.c-id{width:12em}th.c-params{width:30%}
.hint{margin-top:6px;padding-left:8px;border-left:3px solid #ddd}
th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.sev-error{color:#c62828;font-weight:700}.sev-warning{color:#ef6c00;font-weight:700}
.sev-info{color:#1565c0}
dl.kv{display:grid;grid-template-columns:max-content minmax(0,1fr);gap:2px 16px;margin:8px 0}
dl.kv dt{font-weight:600}dl.kv dd{margin:0;overflow-wrap:anywhere}
.scroll{overflow-x:auto;max-width:100%}
.chart-box{max-height:85vh;overflow:auto;margin:8px 0;border:1px solid #eee}
.chart-box img{max-width:100%;height:auto;display:block}
.how{color:#555;font-size:.85em;margin-top:4px}.how code{white-space:normal}
.empty{color:#777;font-style:italic}pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:.8em}
code{font-size:.95em;overflow-wrap:anywhere}
"""


# The notebook fragment's rules, each prefixed with its container's class on use.
_NOTEBOOK_CSS = (
    "h2{font-size:1.1em;margin:12px 0 4px}",
    ".status{display:inline-block;padding:1px 8px;border-radius:4px;color:#fff;font-weight:600}",
    ".failed{background:#c62828}",
    ".passed{background:#2e7d32}",
    "table{border-collapse:collapse;font-size:.88em}",
    "th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}",
    "td{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}",
    "td{overflow-wrap:break-word}",
    "code{overflow-wrap:anywhere}",
    ".hint{margin-top:4px;padding-left:6px;border-left:3px solid #ddd}",
    ".how{color:#555;font-size:.85em;margin-top:4px}",
    ".sev-error{color:#c62828;font-weight:700}",
    ".sev-warning{color:#ef6c00;font-weight:700}",
    ".sev-info{color:#1565c0}",
    "dl.kv{display:grid;grid-template-columns:max-content auto;gap:2px 16px;margin:4px 0}",
    "dl.kv dt{font-weight:600}",
    "dl.kv dd{margin:0}",
    ".empty{color:#777;font-style:italic}",
)


class MissingExtraError(ConfigError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(
            f"the HTML report needs matplotlib ({exc}): pip install gradwatch[html]"
        ) from None


def _e(value: Any) -> str:
    return html.escape(safe(value), quote=True)


def _num(value: Optional[float], fmt: str = ".3g") -> str:
    if value is None:
        return "&ndash;"
    if not math.isfinite(value):
        return _e(value)
    return _e(format(value, fmt))


def _params_cell(f: Finding) -> str:
    names = f.params or ([f.module] if f.module else [])
    shown = ", ".join(f"<code>{_e(n)}</code>" for n in names[:_PARAMS_SHOWN])
    more = len(names) - _PARAMS_SHOWN
    if more > 0:
        rest = _e(", ".join(names[_PARAMS_SHOWN:]))
        shown += f' <span title="{rest}">(+{more} more)</span>'
    return shown


def _header(report: ReportData) -> str:
    status = "failed" if report.failed else "passed"
    cfg = report.config
    items = [
        ("status", f'<span class="status {status}">{status.upper()}</span>'),
        ("optimizer steps", _e(report.steps)),
        ("backward passes", _e(report.backward_passes)),
        ("skipped steps (scaler)", _e(report.skipped_steps)),
        ("findings", _e(len(report.findings)) + f" ({len(report.failing())} at/above fail_on)"),
        ("fail_on", f"<code>{_e(report.fail_on)}</code>"),
        ("every_n_steps", _e(cfg.every_n_steps)),
        ("history", _e(cfg.history)),
        ("ignore", _e(", ".join(cfg.ignore)) or "&ndash;"),
        ("versions", f"gradwatch {_e(report.gradwatch_version)}, torch {_e(report.torch_version)}"),
    ]
    rows = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)
    config_json = _e(cfg.model_dump_json(indent=2))
    return (
        f'<h1>gradwatch report</h1><dl class="kv">{rows}</dl>'
        f"<details><summary>effective config</summary><pre>{config_json}</pre></details>"
    )


def _locations_html(f: Finding) -> str:
    """The finding's source lines (``defined_at``/``called_at``) under its message."""
    parts = [
        f"{label} <code>{_e(f.details[key])}</code>"
        for key, label in (("defined_at", "defined at"), ("called_at", "called at"))
        if f.details.get(key)
    ]
    if f.details.get("first_layers"):  # exploding_grad's spike attribution
        parts.append(f"spike from {_e(clip(spike_layers(f.details), 400))}")
    return f'<br><small class="loc">{"; ".join(parts)}</small>' if parts else ""


def _how(check: str) -> str:
    """Where to read more about a finding's check, and how to silence it."""
    e = _e(check)
    text = f"more: <code>gradwatch explain {e}</code>"
    if check in _SILENCEABLE:
        text += f"; silence: <code>--ignore-check {e}</code>"
    return f'<div class="how">{text}</div>'


_HOW_NOTE = (
    '<p class="how"><code>gradwatch explain &lt;check&gt;</code> tells what a check means and '
    "how to fix what it found. To silence a check, set <code>checks.&lt;check&gt;.enabled: "
    "false</code> in the config file or pass <code>--ignore-check &lt;check&gt;</code> to "
    "<code>gradwatch check</code>; to leave some parameters unjudged, list them in "
    "<code>ignore</code>.</p>"
)


def _findings(report: ReportData) -> str:
    if not report.findings:
        return '<h2>Findings</h2><p class="empty">No findings.</p>'
    rows = []
    ordered = sorted(
        report.findings, key=lambda f: (_SEVERITY_ORDER[f.severity], f.check, f.module or "")
    )
    for f in ordered:
        steps = f"steps {f.first_step}&ndash;{f.last_step} (&times;{f.count})"
        cause = f.cause()
        said = f"<br><small>cause: <code>{_e(clip(cause, 400))}</code></small>" if cause else ""
        if f.details.get("cut"):  # one .detach() cut these parameters off: where
            said += f"<br><small>cut: <code>{_e(name(f.details['cut']))}</code></small>"
        hint = f'<div class="hint">{_e(clip(f.hint))}</div>' if f.hint else ""
        preview = ' <small class="preview">preview</small>' if f.preview() else ""
        rows.append(
            f'<tr><td class="id"><span class="sev-{_e(f.severity)}">{_e(f.severity)}</span>'
            f"{preview}<br><code>{_e(f.check)}</code><br><small>{steps}</small></td>"
            f"<td>{_params_cell(f)}</td>"
            f"<td>{_e(clip(f.message))}{said}{_locations_html(f)}{hint}{_how(f.check)}</td></tr>"
        )
    # The header's widths set the columns (table-layout: fixed).
    head = (
        '<th class="c-id">finding</th><th class="c-params">parameters</th><th>message and hint</th>'
    )
    return (
        f"<h2>Findings</h2>{_HOW_NOTE}"
        f'<div class="scroll"><table class="findings"><tr>{head}</tr>{"".join(rows)}</table></div>'
    )


def _chart(title: str, build: Callable[[ReportData], Any], report: ReportData, empty: str) -> str:
    from gradwatch.render.html_axes import figure_png

    try:
        fig = build(report)
        body = (
            f'<p class="empty">{_e(empty)}</p>'
            if fig is None
            else '<div class="chart-box"><img class="chart" '
            f'alt="{_e(title)}" src="data:image/png;base64,{figure_png(fig)}"></div>'
        )
    except Exception as exc:  # one broken chart must not cost the whole report
        log.warning("gradwatch: could not draw %r: %r", title, exc)
        body = f'<p class="empty">chart failed: {_e(type(exc).__name__)}: {_e(exc)}</p>'
    return f"<h2>{_e(title)}</h2>{body}"


def _coverage(report: ReportData) -> str:
    c = report.coverage
    items = [
        ("trainable parameters", f"{c.trainable} ({c.trainable_numel:,} elements)"),
        ("frozen parameters", f"{c.frozen} ({c.frozen_numel:,} elements)"),
        ("optimizers", str(c.optimizers)),
        ("trainable in an optimizer", f"{c.in_optimizer} / {c.trainable}"),
        ("trainable in no optimizer", str(c.not_in_optimizer)),
        ("frozen but in an optimizer", str(c.frozen_in_optimizer)),
        ("optimizer tensors outside the model", str(c.outside_model)),
    ]
    rows = "".join(f"<dt>{k}</dt><dd>{_e(v)}</dd>" for k, v in items)
    return f'<h2>Coverage</h2><dl class="kv">{rows}</dl>'


def _layers_table(report: ReportData) -> str:
    from gradwatch.render.html_axes import flagged_layers, layer_order

    layers = layer_order(report)
    if not layers:
        return '<h2>Layers</h2><p class="empty">No layer statistics.</p>'
    flags = flagged_layers(report)
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "layer",
            "flag",
            "numel",
            "trainable",
            "in optimizer",
            "grad norm last",
            "mean",
            "max",
            "mean |grad|",
            "update ratio",
            "steps with / without grad",
        )
    )
    rows = []
    for layer in layers:
        rows.append(
            f"<tr><td><code>{_e(layer.name)}</code></td><td>{_e(flags.get(layer.name, ''))}</td>"
            f'<td class="num">{layer.numel:,}</td><td>{"yes" if layer.trainable else "no"}</td>'
            f"<td>{'yes' if layer.in_optimizer else 'no'}</td>"
            f'<td class="num">{_num(layer.grad_norm_last)}</td>'
            f'<td class="num">{_num(layer.grad_norm_mean)}</td>'
            f'<td class="num">{_num(layer.grad_norm_max)}</td>'
            f'<td class="num">{_num(layer.mean_abs_grad)}</td>'
            f'<td class="num">{_num(layer.update_ratio)}</td>'
            f'<td class="num">{layer.steps_with_grad} / {layer.steps_without_grad}</td></tr>'
        )
    return (
        f'<h2>Layers</h2><div class="scroll"><table class="layers"><tr>{head}</tr>'
        f"{''.join(rows)}</table></div>"
    )


def render_html(report: ReportData) -> str:
    """The whole page as a string (``write_html`` writes it).

    Raises:
        MissingExtraError: when matplotlib is not installed (``pip install gradwatch[html]``).
    """
    _require_matplotlib()
    from gradwatch.render.html_heatmap import norm_heatmap
    from gradwatch.render.html_plots import (
        curvature_bars,
        gradient_flow,
        norm_timelines,
        update_ratios,
    )
    from gradwatch.render.html_probes import probes_section

    title = f"gradwatch report: {report.verdict()}"
    parts = [
        _header(report),
        _findings(report),
        _chart("Gradient flow", gradient_flow, report, "No layer statistics were recorded."),
        _chart("Gradient norm history", norm_timelines, report, "No norm history was recorded."),
        _chart(
            "Gradient norm heatmap", norm_heatmap, report, "Fewer than two layers have a history."
        ),
        _chart("Update ratio", update_ratios, report, "No layer statistics were recorded."),
        *([_chart("Curvature", curvature_bars, report, "")] if report.curvature else []),
        probes_section(report),
        _coverage(report),
        _layers_table(report),
    ]
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(parts)
        + "</body></html>\n"
    )


def notebook_html(report: ReportData) -> str:
    """A compact fragment for a notebook cell: status, findings table and coverage.

    No charts (no matplotlib needed, nothing heavy in the notebook file); the page's CSS is
    scoped under one class so it does not restyle the notebook.

    Example:
        >>> html_fragment = notebook_html(watcher.report())  # doctest: +SKIP
    """
    status = "failed" if report.failed else "passed"
    scoped = "".join(f".gradwatch-report {rule}" for rule in _NOTEBOOK_CSS)
    summary = (
        f'<p><span class="status {status}">{status.upper()}</span> '
        f"{_e(report.steps)} optimizer steps, {_e(report.backward_passes)} backward passes, "
        f"{_e(len(report.findings))} finding(s), {len(report.failing())} at/above "
        f"<code>fail_on={_e(report.fail_on)}</code></p>"
    )
    return (
        f'<div class="gradwatch-report"><style>{scoped}</style>'
        f"<strong>gradwatch report</strong>{summary}{_findings(report)}{_coverage(report)}</div>"
    )


def write_html(report: ReportData, path: Path) -> Path:
    """Write the self-contained HTML report to ``path`` atomically and return the path.

    Args:
        report: the report to render.
        path: the target file; parent folders are created.

    Returns:
        ``path``.

    Raises:
        MissingExtraError: when matplotlib is not installed (``pip install gradwatch[html]``).

    Example:
        >>> write_html(watcher.report(), Path("report.html"))  # doctest: +SKIP
    """
    from gradwatch.report_io import write_text_atomic

    return write_text_atomic(path, render_html(report), what="HTML report")
