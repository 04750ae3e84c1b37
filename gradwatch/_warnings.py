"""One ``GradWatchWarning`` per finding, raised at the user's line (past gradwatch's and the
frameworks' frames), and the one line it says."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from gradwatch._text import safe
from gradwatch.errors import GradWatchWarning
from gradwatch.results import Finding

__all__ = ["FRAMEWORKS", "skipped_prefixes", "warn_at_user", "warning_text"]

_OWN = os.path.dirname(os.path.abspath(__file__))  # the gradwatch package
#: Frameworks that call the user's code: a warning raised inside their call into the
#: user's training step points past them, at the user's own line (``trainer.fit()``,
#: ``trainer.train()``, ``loss.backward()``). Only those already imported are looked up.
FRAMEWORKS = (
    "torch",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "transformers",
    "accelerate",
)


def skipped_prefixes() -> tuple[str, ...]:
    """The directories whose frames a warning skips: gradwatch's own and the frameworks'.

    Each ends with a separator, so ``torch`` does not also skip ``torchvision`` or a user's
    ``torch_utils.py``.
    """
    dirs = [_OWN]
    for name in FRAMEWORKS:
        file = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(file, str):
            dirs.append(os.path.dirname(os.path.abspath(file)))
    return tuple(d.rstrip(os.sep) + os.sep for d in dirs)


def _user_frame(prefixes: tuple[str, ...]) -> tuple[int, Any]:
    """The stacklevel (for a ``warnings.warn`` called by :func:`warn_at_user`) and the frame of the
    first caller outside ``prefixes``: the user's line."""
    frame = sys._getframe(2)  # the caller of warn_at_user
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level, frame


def warn_at_user(text: str) -> None:
    """One ``GradWatchWarning`` at the user's line (the first frame outside gradwatch and
    :data:`FRAMEWORKS`: ``skip_file_prefixes`` on Python >= 3.12, a ``stacklevel`` before).

    It runs inside ``step()``/``backward()`` hooks: a filter that turns warnings into errors
    (``-W error``, pytest's ``filterwarnings = error``) would stop training, which only
    ``fail_fast`` may do. The warning it refused is shown instead (``warnings.showwarning``);
    the finding is in the report, which fails the run as usual.
    """
    prefixes = skipped_prefixes()
    try:
        if sys.version_info >= (3, 12):
            warnings.warn(text, GradWatchWarning, skip_file_prefixes=prefixes)
        else:
            warnings.warn(text, GradWatchWarning, stacklevel=_user_frame(prefixes)[0])
    except Exception:
        frame = _user_frame(prefixes)[1]
        where, line = (frame.f_code.co_filename, frame.f_lineno) if frame else ("gradwatch", 0)
        warnings.showwarning(GradWatchWarning(text), GradWatchWarning, where, line)


def warning_text(finding: Finding, key: str) -> str:
    """The one line of a finding's ``GradWatchWarning``: check, what it names, message, hint.

    ``gradwatch ghost_param [transformer.h (146 parameters)]: ... Hint: ...``. A finding
    that groups many parameters is named by its module, group or key, with their count.
    """
    n = len(finding.params)
    label = finding.module or key or (finding.params[0] if n else finding.check)
    if n > 1 or (n == 1 and label != finding.params[0]):
        label += f" ({n} parameter{'s' if n > 1 else ''})"
    where = finding.details.get("defined_at")
    return safe(
        f"gradwatch {finding.check}{' (preview)' if finding.preview() else ''} [{label}]: "
        f"{finding.message}"
        + (f" Hint: {finding.hint}" if finding.hint else "")
        + (f" (defined at {where})" if where else "")
    )
