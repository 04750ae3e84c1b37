"""ghost_param: what it must catch (with the right cause) on real loops."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as cp
from _loops import batches, fired, ghosts, mlp, train
from torch import nn

import gradwatch


class Branchy(nn.Module):
    """A conditional block that is never taken (``use_extra`` stays False)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.extra = nn.Linear(8, 8)
        self.use_extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_extra:
            x = self.extra(x)
        return self.body(x)


class TwoTower(nn.Module):
    """An encoder whose output feeds the head through ``mode``: detach / no_grad / checkpoint."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "detach":
            e = self.encoder(x).detach()
        elif self.mode == "no_grad":
            with torch.no_grad():
                e = self.encoder(x)
        elif self.mode == "inference_mode":
            with torch.inference_mode():
                e = self.encoder(x)
            e = e.clone()
        elif self.mode == "checkpoint":
            e = cp.checkpoint(self.encoder, x, use_reentrant=True)
        else:
            e = self.encoder(x)
        return self.head(torch.cat([x, e], dim=1))


class HFStyleEncoder(nn.Module):
    """Mirrors a Hugging Face encoder: embeddings, layers, a pooler whose output is ignored."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, dim)
        self.layer = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.pooler = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.classifier = nn.Linear(dim, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(ids)
        for layer in self.layer:
            h = layer(h)
        _pooled = self.pooler(h[:, 0])  # computed like in transformers, then ignored
        return self.classifier(h.mean(dim=1))


def _cause(report: gradwatch.Report, param: str) -> str:
    for f in report.by_check("ghost_param"):
        if param in f.params:
            return str(f.details["cause"])
    raise AssertionError(f"{param} is not a ghost: {ghosts(report)}")


def test_unused_branch_is_a_ghost_not_called() -> None:
    model = Branchy()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.01))
    assert ghosts(report) == {"extra.weight", "extra.bias"}
    assert _cause(report, "extra.weight") == "not_called"
    (finding,) = report.by_check("ghost_param")
    assert finding.severity == "error" and finding.module == "extra"
    assert finding.details["steps_missing"] == 4 and finding.details["steps_seen"] == 0
    assert finding.count == 4 and finding.first_step == 0 and finding.last_step == 3
    assert report.failed
    with pytest.raises(gradwatch.GhostLayerError, match=r"extra\.weight"):
        report.raise_for_findings()


@pytest.mark.parametrize(
    ("mode", "cause"),
    [
        ("detach", "disconnected"),
        ("no_grad", "no_grad"),
        ("inference_mode", "no_grad"),
        ("checkpoint", "no_grad"),
    ],
)
def test_encoder_cut_off_from_the_loss(mode: str, cause: str) -> None:
    model = TwoTower(mode)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad", UserWarning)
        report = train(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    expected = {"encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"}
    assert ghosts(report) == expected
    assert {f.details["cause"] for f in report.by_check("ghost_param")} == {cause}
    # One cause, one finding: the encoder's two layers are one ghost named by the encoder
    # (the module whose output was detached, or the subtree that ran without grad).
    (finding,) = report.by_check("ghost_param")
    assert finding.module == "encoder"
    if mode == "detach":
        assert finding.details["cut"] == "encoder"
    if mode == "checkpoint":
        assert "use_reentrant=False" in report.by_check("ghost_param")[0].hint


def test_connected_two_tower_is_clean() -> None:
    model = TwoTower("plain")
    report = train(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    assert report.findings == [] and not report.failed


def test_hf_style_ignored_pooler_is_disconnected() -> None:
    torch.manual_seed(0)
    model = HFStyleEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(m: nn.Module, b: object) -> torch.Tensor:
        ids = torch.randint(0, 50, (4, 6))
        return m(ids).pow(2).mean()

    report = train(model, opt, steps=3, loss=loss)
    assert ghosts(report) == {"pooler.0.weight", "pooler.0.bias"}
    assert _cause(report, "pooler.0.weight") == "disconnected"


def test_compiled_model_with_unused_layer() -> None:
    torch._dynamo.reset()
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="aot_eager")
    with gradwatch.watch(compiled, opt, config={"every_n_steps": 1}) as w:
        for x, y in batches(3):
            opt.zero_grad()
            nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()
    report = w.report()
    assert ghosts(report) == {"extra.weight", "extra.bias"}
    assert fired(report) == {"ghost_param"}


def test_intermittent_ghost_reports_steps_missing_and_seen() -> None:
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for step, (x, y) in enumerate(batches(6)):
            model.use_extra = step % 3 == 0  # taken at steps 0 and 3 only
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    (finding,) = w.report().by_check("ghost_param")
    assert finding.params == ["extra.weight", "extra.bias"]
    assert finding.details["steps_missing"] == 4 and finding.details["steps_seen"] == 2
    assert finding.details["intermittent"] is True
    assert "find_unused_parameters" in finding.hint
    assert finding.first_step == 1 and finding.last_step == 5


def test_stale_gradient_does_not_hide_a_ghost() -> None:
    """A branch used once, then never: its old .grad stays (set_to_none=False), still a ghost."""
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for step, (x, y) in enumerate(batches(4)):
            model.use_extra = step == 0
            opt.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    (finding,) = w.report().by_check("ghost_param")
    assert finding.details["steps_missing"] == 3
    assert model.extra.weight.grad is not None  # .grad alone would have hidden it


def test_without_optimizer_each_backward_is_a_step() -> None:
    model = Branchy()
    report = train(model, None, steps=3)
    assert ghosts(report) == {"extra.weight", "extra.bias"}
    assert report.steps == 3 and report.backward_passes == 3
    assert "not_in_optimizer" not in fired(report, "info")


def test_tied_parameters_are_one_parameter_with_every_name() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.unused_proj = nn.Linear(8, 8, bias=False)
            self.lm_head = nn.Linear(8, 20, bias=False)
            self.lm_head.weight = self.embed.weight
            self.other = nn.Linear(8, 8, bias=False)
            self.other.weight = self.unused_proj.weight  # a tied pair that is never used

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm_head(self.embed(ids))

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(m: nn.Module, b: object) -> torch.Tensor:
        return m(torch.randint(0, 20, (4, 5))).logsumexp(-1).mean()

    report = train(model, opt, steps=2, loss=loss)
    assert ghosts(report) == {"unused_proj.weight", "other.weight"}
    (finding,) = report.by_check("ghost_param")
    assert finding.params == ["unused_proj.weight", "other.weight"]
    assert fired(report) == {"ghost_param"}
    names = {p for layer in report.layers for p in layer.params}
    assert {"embed.weight", "lm_head.weight"} <= names


def test_warning_once_per_finding() -> None:
    """One warning per finding (was: per check and parameter), naming the layer."""
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(gradwatch.GradWatchWarning) as record:
        train(model, opt, steps=5)
    ours = [str(r.message) for r in record if issubclass(r.category, gradwatch.GradWatchWarning)]
    assert len(ours) == 1
    assert "[extra (2 parameters)]" in ours[0]


def test_ignore_patterns_silence_listed_parameters() -> None:
    model = Branchy()
    report = train(
        model, torch.optim.SGD(model.parameters(), lr=0.01), config={"ignore": ["extra.*"]}
    )
    assert report.findings == [] and not report.failed


def test_fail_fast_raises_ghost_layer_error_at_first_step() -> None:
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    with pytest.raises(gradwatch.GhostLayerError, match=r"extra\.weight"):
        with gradwatch.watch(model, opt, config={"fail_fast": True}):
            for x, y in batches(5):
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                steps += 1
    assert steps == 0  # raised from inside the first optimizer.step()
    assert not model.extra.weight._post_accumulate_grad_hooks


def test_optimizer_tensors_outside_the_model_get_synthesized_names() -> None:
    full = nn.ModuleDict({"enc": mlp(), "dec": nn.Linear(1, 1)})
    opt = torch.optim.SGD(full.parameters(), lr=0.01)

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(full["dec"](m(b[0])), b[1])

    report = train(full["enc"], opt, loss=loss)  # watching a submodule only
    assert report.findings, "the outside tensors must be noted"
    (note,) = report.by_check("param_outside_model")
    assert note.severity == "info"
    assert note.params == ["optimizer[0].group[0][4]", "optimizer[0].group[0][5]"]
    assert fired(report) == set()


def test_model_without_trainable_parameters_is_a_one_line_error() -> None:
    model = mlp().requires_grad_(False)
    with pytest.raises(gradwatch.ConfigError, match="no trainable parameters") as info:
        gradwatch.watch(model).__enter__()
    assert "\n" not in str(info.value)


def test_report_is_readable_during_and_after_the_loop() -> None:
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1}) as w:
        for k, (x, y) in enumerate(batches(3)):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            assert w.report().steps == k + 1
    after = w.report()
    assert gradwatch.Report.model_validate_json(after.model_dump_json()) == after


def test_a_ghost_after_trim_hooks_after_gets_its_cause_from_its_next_missing_step() -> None:
    """Forward hooks are trimmed after ``trim_hooks_after``; a late ghost gets one back."""
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "trim_hooks_after": 2}) as w:
        for step, (x, y) in enumerate(batches(8)):
            model.use_extra = step < 4  # the branch stops being taken at step 4
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == 3:
                assert set(w._hooks.forward) == set()  # clean so far: no forward hook left
    (finding,) = w.report().by_check("ghost_param")
    assert finding.first_step == 4 and finding.details["cause"] == "not_called"
    assert finding.details["steps_missing"] == 4 and finding.details["steps_seen"] == 4
    assert set(w._hooks.forward) == set()  # removed on exit


def test_forward_hooks_stay_on_ghost_layers_only() -> None:
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with gradwatch.watch(model, opt, config={"every_n_steps": 1, "trim_hooks_after": 2}) as w:
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        assert set(w._hooks.forward) == {"extra"}
        assert not model.body[0]._forward_hooks and model.extra._forward_hooks


def test_warnings_point_at_the_users_line() -> None:
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.warns(gradwatch.GradWatchWarning) as record:
        with gradwatch.watch(model, opt):
            x, y = batches(1)[0]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # the ghost is decided here
    ours = [r for r in record if issubclass(r.category, gradwatch.GradWatchWarning)]
    assert ours and {r.filename for r in ours} == {__file__}
