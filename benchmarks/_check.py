"""``overhead.py --check``: this run's ratios against the committed figures (a regression guard).

Each gradwatch variant's added time per step is a ratio to ``clip_grad_norm_``'s, measured in
the same process (``x_clip``). ``--check`` compares this run's ratios with the ones committed
in ``benchmarks/results.json`` (the figures RESULTS.md reports) and prints one line per
variant. A ratio above ``tolerance`` times its committed figure is ``REGRESSED``: a round that
adds cost says so. The tolerance is wide because a shared CI machine is noisy; CI runs it as
a report line that never fails the build (``--strict`` makes it fail, for a quiet machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["COMMITTED", "compare"]

COMMITTED = Path(__file__).resolve().parent / "results.json"


def compare(result: dict[str, Any], committed: Path, tolerance: float) -> tuple[list[str], bool]:
    """The report lines and whether every compared ratio stayed within ``tolerance``."""
    try:
        old = json.loads(committed.read_text(encoding="utf-8"))["models"]
    except (OSError, KeyError, ValueError) as exc:
        return [f"overhead check: cannot read the committed figures {committed}: {exc}"], True
    lines: list[str] = []
    ok = True
    for key, res in result.get("models", {}).items():
        before = old.get(key, {}).get("variants", {})
        for name, row in res["variants"].items():
            then = before.get(name, {}).get("x_clip")
            now = row.get("x_clip")
            if name.startswith("gradwatch") and now is None and then:
                lines.append(
                    f"overhead check: ({key}) {name}: no ratio, clip_grad_norm_'s added time "
                    "was not above zero in this run (a noisy host)"
                )
            if not name.startswith("gradwatch") or now is None or not then:
                continue
            limit = then * tolerance
            regressed = now > limit
            ok = ok and not regressed
            verdict = "REGRESSED" if regressed else "ok"
            lines.append(
                f"overhead check: ({key}) {name} {now:.2f}x clip (committed {then:.2f}x, "
                f"limit {limit:.2f}x): {verdict}"
            )
    if not lines:
        lines.append("overhead check: no gradwatch variant to compare with the committed figures")
    return lines, ok
