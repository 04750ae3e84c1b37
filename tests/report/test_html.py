"""The self-contained HTML report: content, charts, robustness, and a real headless browser."""

from __future__ import annotations

import base64
import io
import math
import os
import re
import shutil
import subprocess
import sys
from html import unescape as html_unescape
from pathlib import Path

import pytest
import torch
from torch import nn

import gradwatch
from gradwatch import ConfigError, Finding, GradWatchConfig, LayerStats, Report

mpimg = pytest.importorskip("matplotlib.image")
from gradwatch.render import html_axes  # noqa: E402
from gradwatch.render import html_plots as plots  # noqa: E402

NAN, INF = float("nan"), float("inf")
IMG = re.compile(r'<img class="chart" alt="([^"]*)" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


class GhostNet(nn.Module):
    """Defined out of forward order; ``ghost`` never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 1)
        self.ghost = nn.Linear(16, 16)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _train(model: nn.Module, steps: int = 12, poison_at: int | None = None) -> Report:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "probes": "off"}) as w:
        for step in range(steps):
            x = torch.randn(8, 8)
            if step == poison_at:
                x[0, 0] = float("inf")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.zeros(8, 1)).backward()
            opt.step()
    return w.report()


def _empty(**kw: object) -> Report:
    return Report(gradwatch_version="0", torch_version="0", config=GradWatchConfig(), **kw)


def _charts(page: str) -> dict[str, object]:
    """The inline PNGs of a page, decoded to pixel arrays."""
    return {
        alt: mpimg.imread(io.BytesIO(base64.b64decode(data))) for alt, data in IMG.findall(page)
    }


def _assert_offline(page: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//|file:)""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "@import" not in page and "url(" not in page


@pytest.fixture(scope="module")
def ghost_report() -> Report:
    return _train(GhostNet())


def test_real_loop_report_has_every_section(ghost_report: Report, tmp_path: Path) -> None:
    pyplot = sys.modules.get("matplotlib.pyplot")
    figures_before = pyplot.get_fignums() if pyplot is not None else None
    path = ghost_report.to_html(tmp_path / "out" / "report.html")
    # Figures are drawn without pyplot: nothing imported, nothing left in its registry.
    if pyplot is None:
        assert "matplotlib.pyplot" not in sys.modules
    else:
        assert pyplot.get_fignums() == figures_before
    assert path == tmp_path / "out" / "report.html"
    page = path.read_text(encoding="utf-8")
    assert re.search(r"<title>gradwatch report[^<]*FAILED</title>", page)
    _assert_offline(page)
    for section in (
        "Findings",
        "Gradient flow",
        "Gradient norm history",
        "Update ratio",
        "Coverage",
        "Layers",
    ):
        assert f"<h2>{section}</h2>" in page
    assert "ghost_param" in page and "<code>ghost.weight</code>" in page and "not_called" in page
    assert "<dt>optimizer steps</dt><dd>12</dd>" in page
    assert "<dt>trainable in an optimizer</dt><dd>8 / 8</dd>" in page
    charts = _charts(page)
    assert set(charts) == {
        "Gradient flow",
        "Gradient norm history",
        "Gradient norm heatmap",
        "Update ratio",
    }
    for name, pixels in charts.items():
        assert pixels.shape[0] > 200 and pixels.shape[1] > 400, name
        assert float(pixels[..., :3].std()) > 0.05, f"{name} chart is blank"


def test_layers_drawn_in_forward_order_with_ghost_marked(ghost_report: Report) -> None:
    assert [layer.name for layer in html_axes.layer_order(ghost_report)] == [
        "fc1",
        "fc2",
        "head",
        "ghost",
    ]
    assert html_axes.flagged_layers(ghost_report) == {"ghost": "ghost"}
    fig = plots.gradient_flow(ghost_report)
    ax = fig.axes[0]
    # One row per layer, first layer on top (the y axis is inverted).
    assert [t.get_text() for t in ax.get_yticklabels()] == ["fc1", "fc2", "head", "ghost"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.texts] == ["ghost"]
    assert ax.get_yticklabels()[3].get_color() != ax.get_yticklabels()[0].get_color()
    lengths = [p.get_width() for p in ax.patches[4:8]]  # the mean |grad| bars
    assert all(w > 0 for w in lengths[:3]) and lengths[3] == 0.0  # nothing for the ghost


def test_update_ratio_chart_has_the_rule_of_thumb(ghost_report: Report) -> None:
    ax = plots.update_ratios(ghost_report).axes[0]
    assert any(list(line.get_xdata()) == [1e-3, 1e-3] for line in ax.lines)
    measured = [
        point
        for c in ax.collections
        if c.get_label().startswith(("within", "outside"))
        for point in c.get_offsets()
    ]
    assert len(measured) == 3  # fc1, fc2, head; the ghost had no update
    assert "1e-3 rule of thumb" in ax.get_legend_handles_labels()[1]


def test_timeline_keeps_top_k_and_every_flagged_layer() -> None:
    layers = [
        LayerStats(
            name=f"l{i}",
            params=[f"l{i}.w"],
            numel=1,
            forward_order=i,
            history=[(s, 10.0 ** (i - 6) * (1 + s)) for s in range(5)],
        )
        for i in range(12)
    ]
    tiny = Finding(check="vanishing_grad", severity="warning", message="m", module="l0")
    report = _empty(layers=layers, findings=[tiny])
    labels = plots.norm_timelines(report, k=3).axes[0].get_legend_handles_labels()[1]
    assert labels == ["l0 (flagged)", "l9", "l10", "l11"]


def test_empty_report_renders(tmp_path: Path) -> None:
    page = _empty().to_html(tmp_path / "e.html").read_text()
    assert "<title>gradwatch report: passed</title>" in page
    assert "No findings." in page and "No layer statistics" in page
    assert not _charts(page)


def test_nonfinite_norms_from_a_real_loop(tmp_path: Path) -> None:
    report = _train(GhostNet(), steps=6, poison_at=3)
    assert report.by_check("nonfinite_grad")
    assert any(not math.isfinite(v) for layer in report.layers for _, v in layer.history)
    page = report.to_html(tmp_path / "nan.html").read_text()
    assert len(_charts(page)) == 4 and "chart failed" not in page


def test_nonfinite_zero_and_missing_values_everywhere(tmp_path: Path) -> None:
    layers = [
        LayerStats(
            name="a",
            params=["a.w"],
            numel=3,
            mean_abs_grad=NAN,
            max_abs_grad=INF,
            update_ratio=NAN,
            grad_norm_last=INF,
            history=[(0, 1.0), (1, NAN), (2, INF), (3, 0.0)],
            forward_order=1,
        ),
        LayerStats(
            name="b",
            params=["b.w"],
            numel=3,
            mean_abs_grad=0.0,
            max_abs_grad=0.0,
            update_ratio=0.0,
            history=[(0, 0.0), (1, 0.0)],
            forward_order=0,
        ),
        LayerStats(name="c", params=["c.w"], numel=3, history=[(0, NAN)]),
    ]
    dead = Finding(check="dead_param", severity="warning", message="dead", module="b")
    page = _empty(layers=layers, findings=[dead]).to_html(tmp_path / "x.html").read_text()
    assert len(_charts(page)) == 4 and "chart failed" not in page
    assert "<td>dead</td>" in page  # the layer table's flag column


def test_many_layers_thin_the_tick_labels() -> None:
    layers = [
        LayerStats(
            name=f"blocks.{i}.mlp",
            params=[f"blocks.{i}.mlp.w"],
            numel=4,
            mean_abs_grad=1e-4 * (i + 1),
            max_abs_grad=1e-3 * (i + 1),
            forward_order=i,
        )
        for i in range(400)
    ]
    ghost = Finding(check="ghost_param", severity="error", message="m", module="blocks.333.mlp")
    fig = plots.gradient_flow(_empty(layers=layers, findings=[ghost]))
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) <= 151 and "blocks.333.mlp" in labels  # thinned
    assert fig.get_figheight() <= 26.0  # 400 rows are thinner, not a 70-inch page


def test_text_is_escaped(tmp_path: Path) -> None:
    evil = Finding(
        check="ghost_param",
        severity="error",
        message="<script>alert(1)</script>",
        hint='"><img src=x onerror=alert(1)>',
        params=["a<b>.weight"],
        module="a<b>",
    )
    page = _empty(findings=[evil], failed=True).to_html(tmp_path / "x.html").read_text()
    assert "<script>" not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a&lt;b&gt;.weight" in page


def test_missing_matplotlib_names_the_extra(
    ghost_report: Report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install gradwatch\[html\]") as info:
        ghost_report.to_html(tmp_path / "r.html")
    assert isinstance(info.value, ConfigError)
    assert not (tmp_path / "r.html").exists()


def test_directory_target_is_a_config_error(ghost_report: Report, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        ghost_report.to_html(tmp_path)


class Deep(nn.Module):
    """``n`` residual blocks, a ghost head that never runs, and one dead ReLU block."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.ghost_head_with_a_long_descriptive_name_that_does_not_fit_a_column = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)
        self.dead = n // 3
        with torch.no_grad():
            self.blocks[self.dead].bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = x + (torch.relu(block(x)) if i == self.dead else 0.05 * torch.tanh(block(x)))
        return self.out(x)


def _train_deep(n: int, steps: int = 6) -> Report:
    torch.manual_seed(0)
    model = Deep(n)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradwatch.watch(
        model, opt, config={"every_n_steps": 1, "warn": False, "probes": "off"}
    ) as w:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 8)).pow(2).mean().backward()
            opt.step()
    return w.report()


@pytest.fixture(scope="module")
def deep100() -> Report:
    return _train_deep(100)


def test_charts_of_100_layers_grow_a_readable_row_per_layer(deep100: Report) -> None:
    n = len(deep100.layers)
    assert n == 102 and {f.check for f in deep100.findings} >= {"ghost_param", "dead_param"}
    for build in (plots.gradient_flow, plots.update_ratios):
        fig = build(deep100)
        labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
        assert len(labels) == n  # every layer named, none thinned out
        assert fig.get_figheight() / n >= 0.15  # >= 15 px a row at 100 dpi: no strip
        assert fig.get_figheight() <= 26.0
    small = plots.gradient_flow(_train_deep(24))
    assert 4.0 <= small.get_figheight() <= 8.0  # 24 layers: a chart, not a strip
    from gradwatch.render.html_heatmap import norm_heatmap

    heat = norm_heatmap(deep100)
    image = heat.axes[0].images[0].get_array()
    with_history = [layer for layer in deep100.layers if layer.history]
    assert image.shape == (len(with_history), 6)  # a row per layer, a column per step
    dead = [layer.name for layer in html_axes.layer_order(deep100) if layer.history].index(
        f"blocks.{100 // 3}"
    )
    # Every norm is a colour but the dead block's exact zeros (no log), marked instead.
    assert {int(row) for row in image.mask.nonzero()[0]} == {dead}
    scatter = heat.axes[0].collections[0]  # the dead block's zero norms, marked orange
    assert scatter.get_label() == "zero norm"
    assert {int(y) for _, y in scatter.get_offsets()} == {dead}


def test_orange_points_are_in_the_legend() -> None:
    layers = [
        LayerStats(name=f"l{i}", params=[f"l{i}.w"], numel=4, forward_order=i, update_ratio=r)
        for i, r in enumerate([1e-3, 2e-3, 0.5, 1e-7])
    ]
    ax = plots.update_ratios(_empty(layers=layers)).axes[0]
    handles, labels = ax.get_legend_handles_labels()
    outside = [h for h, label in zip(handles, labels) if label.startswith("outside 1e-4")]
    assert len(outside) == 1 and len(outside[0].get_offsets()) == 2  # 0.5 and 1e-7
    assert outside[0].get_facecolor()[0][:3] == pytest.approx((0xEF / 255, 0x6C / 255, 0.0))
    legend = ax.figure.legends[0]
    assert "outside 1e-4 .. 1e-2 (lr too high or too low)" in [t.get_text() for t in legend.texts]


def test_each_finding_says_how_to_explain_and_silence_its_check(tmp_path: Path) -> None:
    from gradwatch.cli.main import main

    report = _train_deep(4)
    page = report.to_html(tmp_path / "r.html").read_text(encoding="utf-8")
    checks = {f.check for f in report.findings}
    assert checks == {"ghost_param", "dead_param"}
    for check in checks:
        assert f"<code>gradwatch explain {check}</code>" in page
        assert f"<code>--ignore-check {check}</code>" in page
        assert main(["explain", check]) == 0  # the command the page names works
        config = GradWatchConfig.model_validate({"checks": {check: {"enabled": False}}})
        assert not config.check(check).enabled  # the key the page names is real
    assert "<code>checks.&lt;check&gt;.enabled: false</code>" in page
    grouped = Finding(
        check="ghost_param",
        severity="error",
        message="m",
        params=[f"h.{i}.weight" for i in range(12)],
        details={"cause": "disconnected", "cut": "ln_<f>"},
    )
    cut = _empty(findings=[grouped]).to_html(tmp_path / "g.html").read_text(encoding="utf-8")
    assert "cut: <code>ln_&lt;f&gt;</code>" in cut  # the module whose output was detached
    internal = Finding(check="internal_error", severity="error", message="m")
    own = _empty(findings=[internal]).to_html(tmp_path / "i.html").read_text(encoding="utf-8")
    assert "gradwatch explain internal_error" in own and "--ignore-check internal" not in own


def _chromium() -> str | None:
    for candidate in ("chromium", "chromium-browser"):
        found = shutil.which(candidate)
        if found:
            return found
    return "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None


@pytest.mark.slow
def test_report_renders_in_headless_chromium(ghost_report: Report, tmp_path: Path) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (bash .ci/browser installs it)")
    html_path = ghost_report.to_html(tmp_path / "report.html")
    out_dir = Path(os.environ.get("GRADWATCH_ARTIFACTS") or tmp_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "report-screenshot.png"
    shot.unlink(missing_ok=True)
    flags = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]
    url = html_path.resolve().as_uri()
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1280,2000", url],
        capture_output=True,
        timeout=180,
        check=False,
    )
    print(f"report screenshot: {shot}")
    assert shot.exists(), "chromium wrote no screenshot"
    pixels = mpimg.imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (2000, 1280)
    assert float(pixels.std()) > 0.1, "the page rendered blank"
    not_white = (pixels < 0.9).any(axis=-1).mean()
    assert not_white > 0.03, f"only {not_white:.1%} of the page is drawn"
    red = ((pixels[..., 0] > 0.6) & (pixels[..., 1] < 0.3) & (pixels[..., 2] < 0.3)).sum()
    assert red > 500, "the FAILED badge / ghost markers are missing"
    dom = subprocess.run(
        [*flags, "--dump-dom", url], capture_output=True, text=True, timeout=180, check=False
    ).stdout
    assert re.search(r"<title>gradwatch report: FAILED</title>", dom)
    assert len(IMG.findall(dom)) == 4


# Run in the browser on a copy of the page (the report itself runs no script): the page's
# width against the window's, what sticks out of it outside a scroll container, and each
# chart's natural and shown size.
_PROBE = """<script>
window.addEventListener("load", () => {
  const width = window.innerWidth;
  const out = [...document.body.querySelectorAll("*")]
    .filter((e) => !e.closest(".scroll, .chart-box") && e.getBoundingClientRect().right > width + 0.5)
    .map((e) => e.tagName + "." + e.className);
  const charts = [...document.querySelectorAll(".chart-box")].map((box) => {
    const img = box.querySelector("img");
    return {alt: img.alt, natural: img.naturalHeight, shown: img.getBoundingClientRect().height,
            box: box.getBoundingClientRect().height, scrolls: box.scrollHeight > box.clientHeight};
  });
  const findings = document.querySelector("table.findings");
  const probe = document.createElement("pre");
  probe.id = "probe";
  probe.textContent = JSON.stringify({
    scrollWidth: document.documentElement.scrollWidth, innerWidth: width,
    innerHeight: window.innerHeight, out, charts,
    findingsWidth: findings.getBoundingClientRect().width,
    findingsRoom: findings.parentElement.clientWidth,
  });
  document.body.appendChild(probe);
});
</script>"""


def _probe(browser: str, page: Path, width: int, profile: Path) -> dict[str, object]:
    import json

    probed = page.with_name(f"probe-{width}-{page.name}")
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"))
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--window-size={width},1000",
            "--virtual-time-budget=5000",
            "--dump-dom",
            probed.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    ).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, f"the probe did not run: {dom[-500:]!r}"
    return json.loads(html_unescape(found.group(1)))


@pytest.mark.slow
@pytest.mark.parametrize("layers", [24, 100])
def test_nothing_overflows_at_800_and_1400_px_in_chromium(
    layers: int, deep100: Report, tmp_path: Path
) -> None:
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (bash .ci/browser installs it)")
    report = deep100 if layers == 100 else _train_deep(layers)
    page = report.to_html(tmp_path / f"deep{layers}.html")
    for width in (800, 1400):
        seen = _probe(browser, page, width, tmp_path / "profile")
        assert seen["innerWidth"] == width
        assert seen["scrollWidth"] <= width, seen  # no horizontal scroll bar on the page
        assert seen["out"] == [], seen  # nothing sticks out of the window
        assert seen["findingsWidth"] <= seen["findingsRoom"] + 0.5, seen  # no table scroll
        charts = {c["alt"]: c for c in seen["charts"]}
        assert set(charts) == {
            "Gradient flow",
            "Gradient norm history",
            "Gradient norm heatmap",
            "Update ratio",
        }
        for name in ("Gradient flow", "Update ratio", "Gradient norm heatmap"):
            chart = charts[name]
            # A row a layer at >= 10 px on screen: no strip, whatever the width ...
            assert chart["shown"] / (layers + 2) >= 10, (width, chart)
            # ... and a chart taller than most of the window scrolls in its own box.
            assert chart["box"] <= 0.86 * seen["innerHeight"] + 2, (width, chart)
            assert chart["scrolls"] == (chart["shown"] > chart["box"] + 2), (width, chart)
