"""Source locations of findings: where a flagged layer was created and which line called it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

import gradwatch
from gradwatch.model.locations import call_site, defined_at, where
from gradwatch.report import Finding

HERE = Path(__file__)


def line_of(marker: str) -> str:
    """``file:line`` of the only line of this file that contains ``marker`` (cwd-relative)."""
    lines = HERE.read_text(encoding="utf-8").splitlines()
    hits = [k + 1 for k, text in enumerate(lines) if marker in text and "line_of(" not in text]
    assert len(hits) == 1, (marker, hits)
    path = os.path.relpath(HERE) if str(HERE.resolve()).startswith(os.getcwd() + os.sep) else HERE
    return f"{path}:{hits[0]}"


class ThreeGhosts(nn.Module):
    """The three ghost causes that have a source line to show."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.text_proj = nn.Linear(8, 8)  # <no_grad defined>
        self.pooler = nn.Linear(8, 8)  # <disconnected defined>
        self.aux_head = nn.Linear(8, 2)  # <not_called defined>
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        with torch.no_grad():
            t = self.text_proj(h)  # <no_grad called>
        _unused = self.pooler(h)  # <disconnected called>
        return self.out(h + t)


def _train(model: nn.Module, steps: int = 3, **config: object) -> gradwatch.Report:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, **config}) as w:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
    return w.report()


def _ghost(report: gradwatch.Report, module: str) -> Finding:
    (found,) = [f for f in report.by_check("ghost_param") if f.module == module]
    return found


def test_each_ghost_cause_points_at_its_lines() -> None:
    report = _train(ThreeGhosts())
    causes = {f.module: f.details["cause"] for f in report.by_check("ghost_param")}
    assert causes == {"text_proj": "no_grad", "pooler": "disconnected", "aux_head": "not_called"}
    for module, cause in causes.items():
        details = _ghost(report, module).details
        assert details["defined_at"] == line_of(f"<{cause} defined>"), module
        if cause == "not_called":
            assert "called_at" not in details  # it never ran: no caller to show
        else:
            assert details["called_at"] == line_of(f"<{cause} called>"), module


def test_call_site_captured_after_the_last_step_still_reaches_the_report() -> None:
    # The finding asks for its call site at step 0; the next forward (here an evaluation
    # pass after the only step) records it, and the report built afterwards carries it even
    # though no later step re-emitted the finding.
    model = ThreeGhosts()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt) as w:
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        assert "called_at" not in _ghost(w.report(), "pooler").details
        model(torch.randn(4, 8))
    assert _ghost(w.report(), "pooler").details["called_at"] == line_of("<disconnected called>")


def test_locations_survive_trimmed_hooks_and_are_in_every_output(tmp_path: Path) -> None:
    report = _train(ThreeGhosts(), steps=12, trim_hooks_after=2)
    pooler = _ghost(report, "pooler")
    assert pooler.details["called_at"] == line_of("<disconnected called>")
    text = report.summary(width=100)
    assert line_of("<disconnected defined>") in text and line_of("<disconnected called>") in text
    assert "self.pooler = nn.Linear(8, 8)" in text  # the source line itself, for a local file
    from gradwatch.render.junit import junit_xml
    from gradwatch.render.sarif import sarif_log

    assert f"defined at: {line_of('<not_called defined>')}" in junit_xml(report)
    html = tmp_path / "r.html"
    report.to_html(html)
    assert line_of("<no_grad called>") in html.read_text(encoding="utf-8")
    results = sarif_log(report)["runs"][0]["results"]
    (res,) = [r for r in results if r["locations"][0]["logicalLocations"][0]["name"] == "pooler"]
    path, _, line = line_of("<disconnected defined>").rpartition(":")
    loc = res["locations"][0]["physicalLocation"]
    assert loc["artifactLocation"]["uri"].endswith(Path(path).name)
    assert loc["region"]["startLine"] == int(line)
    assert res["relatedLocations"][0]["physicalLocation"]["region"]["startLine"] == int(
        line_of("<disconnected called>").rpartition(":")[2]
    )


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inherited = nn.Linear(8, 8)  # <inherited>


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)  # <nested>

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class Deep(Base):
    """Ghosts in a subclass's parent, a nested block, a container and a helper method."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.stack = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # <container>
        self._build_heads()
        self.add_module("registered", nn.Linear(8, 8))  # <add_module>

    def _build_heads(self) -> None:
        self.late_head = nn.Linear(8, 1)  # <helper>

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.late_head(self.stack[0](self.block(x)))


def test_defined_at_walks_the_mro_nesting_containers_and_helpers() -> None:
    model = Deep()
    assert defined_at(model, "inherited") == line_of("<inherited>")
    assert defined_at(model, "block.side") == line_of("<nested>")
    assert defined_at(model, "stack.1") == line_of("<container>")
    assert defined_at(model, "late_head") == line_of("<helper>")
    assert defined_at(model, "registered") == line_of("<add_module>")
    assert defined_at(model, "no.such") is None
    report = _train(Deep())
    found = {f.module: f.details.get("defined_at") for f in report.by_check("ghost_param")}
    assert found == {
        "inherited": line_of("<inherited>"),
        "block.side": line_of("<nested>"),
        "stack.1": line_of("<container>"),
        "registered": line_of("<add_module>"),
    }


def test_torch_modules_and_sourceless_classes_give_no_line_not_an_error() -> None:
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert defined_at(plain, "1") is None and defined_at(plain, "(root)") is None
    namespace: dict[str, object] = {"nn": nn}
    exec(  # a class whose source inspect cannot read
        "class Dyn(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = nn.Linear(2, 2)\n",
        namespace,
    )
    assert defined_at(namespace["Dyn"](), "a") is None  # type: ignore[operator]


def test_where_is_relative_inside_cwd_and_absolute_outside(tmp_path: Path) -> None:
    inside = os.path.join(os.getcwd(), "pkg", "m.py")
    assert where(inside, 3) == os.path.join("pkg", "m.py") + ":3"
    outside = str(tmp_path / "m.py")
    if not outside.startswith(os.getcwd() + os.sep):
        assert where(outside, 7) == outside + ":7"


def test_forward_nan_origin_gets_its_call_site_from_the_forward_hook() -> None:
    # The hook-up a forward-NaN finding (details.phase == "forward") uses: the first forward
    # of the origin module after the finding asks records the caller's line, once.
    model = ThreeGhosts()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradwatch.watch(model, opt, config={"trim_hooks_after": None}) as w:
        finding = Finding(
            check="nonfinite_grad",
            severity="error",
            message="m",
            module="pooler",
            details={"phase": "forward", "origin_module": "pooler"},
        )
        locations = w._log.locations
        assert locations is not None
        locations.annotate(finding)
        assert "called_at" not in finding.details and "pooler" in w._tracker.want_call
        model(torch.randn(2, 8))
        assert not w._tracker.want_call  # captured once, then off
        locations.annotate(finding)
    assert finding.details["called_at"] == line_of("<disconnected called>")
    assert finding.details["defined_at"] == line_of("<disconnected defined>")


def test_call_site_skips_torch_and_gradwatch_frames() -> None:
    site = call_site()
    assert site is not None and site.startswith(os.path.relpath(HERE))
