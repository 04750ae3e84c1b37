"""Upload the written report to the loggers that store files (MLflow, W&B) as an artifact.

One small uploader per kind of logger, picked by what the logger exposes, not by importing
its package: the callback never needs MLflow or W&B installed, and adding a logger kind
means adding an uploader here, not a branch in the callback. Loggers that write to a local
folder (CSV, TensorBoard) get the report in that folder already and need no upload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["upload_report"]

Uploader = Callable[[Any, Path], None]


def _mlflow(logger: Any) -> Optional[Uploader]:
    """``MLFlowLogger``: ``MlflowClient.log_artifact(run_id, path, artifact_path)``."""
    if not hasattr(logger, "run_id") or not hasattr(logger, "experiment_id"):
        return None

    def upload(lg: Any, path: Path) -> None:
        lg.experiment.log_artifact(lg.run_id, str(path), "gradwatch")

    return upload


def _wandb(logger: Any) -> Optional[Uploader]:
    """``WandbLogger``: ``Run.save(path, base_path=..., policy="now")`` (a run file)."""
    if type(logger).__name__ != "WandbLogger":
        return None

    def upload(lg: Any, path: Path) -> None:
        lg.experiment.save(str(path), base_path=str(path.parent), policy="now")

    return upload


UPLOADERS: list[Callable[[Any], Optional[Uploader]]] = [_mlflow, _wandb]


def upload_report(loggers: list[Any], path: Path) -> list[str]:
    """Log the report file ``path`` with every logger that stores artifacts.

    Args:
        loggers: the Trainer's loggers.
        path: the report file written on this rank.

    Returns:
        The class names of the loggers it was uploaded to.

    Raises:
        Exception: whatever an upload raised (the callback turns it into a warning).

    Example:
        >>> upload_report(trainer.loggers, Path("lightning_logs/gradwatch-report.json"))  # doctest: +SKIP
        ['MLFlowLogger']
    """
    done = []
    for logger in loggers:
        for pick in UPLOADERS:
            upload = pick(logger)
            if upload is not None:
                upload(logger, path)
                done.append(type(logger).__name__)
                break
    return done
