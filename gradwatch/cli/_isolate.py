"""``gradwatch check`` runs the probe in a child process, so that nothing in it passes for a result.

A factory or ``loss_fn`` that calls ``sys.exit(0)`` or ``os._exit(0)``, a segfault in native
code, or a data source that hangs must never end ``gradwatch check`` with status 0. The
parent (:func:`run_isolated`) starts ``python`` on :func:`child_main` in a new process group,
passes the request in a file, and accepts only the result file the child writes after the
probe completed. The child exits with ``os._exit`` right after writing it, so leftover
non-daemon threads cannot keep it alive; the parent then kills whatever is left in the
child's process group (DataLoader workers). A child that dies without a result, or runs
past the timeout (its whole process group is killed), is a one-line error.

When the parent dies, the child kills its own process group: it watches a pipe that only
the parent holds open.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

__all__ = ["child_main", "run_here", "run_isolated"]

# The child imports gradwatch from where the parent found it, then takes the parent's sys.path.
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from gradwatch.cli._isolate import child_main; child_main(sys.argv[2:])"
)


class IsolationError(Exception):
    """The child failed; ``detail`` is its traceback (shown with ``--verbose``)."""

    def __init__(self, line: str, detail: str = "") -> None:
        super().__init__(line)
        self.detail = detail


# -- parent ----------------------------------------------------------------------------------


def _wait(proc: subprocess.Popen[bytes], deadline: Optional[float]) -> bool:
    """Wait until the child exits, without reaping it (so its group id stays ours to kill).

    Returns False when ``deadline`` passed first.
    """
    waitid = getattr(os, "waitid", None)
    if waitid is None:  # pragma: no cover - not POSIX: reaping is fine there (no killpg)
        try:
            proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True
    pause = 0.001
    while waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return True


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (it leads it: ``start_new_session``), then reap it."""
    if proc.returncode is not None:  # reaped: its group id may belong to others now
        return
    killpg = getattr(os, "killpg", None)
    try:
        if killpg is not None:
            killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover - not POSIX
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass  # already gone
    proc.wait()


def _fileno(stream: Any, default: int) -> int:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):  # a replaced sys.stderr (io.StringIO)
        return default


def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (out of memory, or a crash in native code?)"
    return (
        f"exited with status {returncode} without a result (os._exit() or a process exit "
        "inside the target's code?)"
    )


def run_isolated(
    request: dict[str, Any], *, timeout: Optional[float], stdout_to_stderr: bool = False
) -> dict[str, Any]:
    """Run :func:`gradwatch.cli._isolate.probe_result` on ``request`` in a child process.

    Args:
        request: what the child runs (see :func:`probe_result`); ``sys_path`` is added.
        timeout: seconds before the child's process group is killed; ``None`` waits forever.
        stdout_to_stderr: send the child's standard output to standard error (when the
            parent's stdout carries ``--json -``).

    Returns:
        The child's result: ``report`` (JSON text), ``losses`` and ``elapsed``.

    Raises:
        IsolationError: one line: the child's own error, its death, or the timeout.
    """
    root = str(Path(__file__).resolve().parents[2])  # the folder holding the gradwatch package
    posix = os.name == "posix"
    with tempfile.TemporaryDirectory(prefix="gradwatch-check-") as tmp:
        req, res = Path(tmp, "request.json"), Path(tmp, "result.json")
        sys_path = [str(p) for p in sys.path]
        req.write_text(json.dumps({**request, "sys_path": sys_path}), encoding="utf-8")
        life_r, life_w = os.pipe()
        try:
            sys.stdout.flush()  # keep the parent's and the child's output in order
            sys.stderr.flush()
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, root, str(req), str(res), str(life_r)],
                stdin=subprocess.DEVNULL,
                stdout=_fileno(sys.stderr, 2) if stdout_to_stderr else None,
                pass_fds=(life_r,) if posix else (),
                start_new_session=posix,  # its own process group: a timeout kills all of it
            )
        except BaseException:
            os.close(life_w)
            raise
        finally:
            os.close(life_r)
        try:
            deadline = None if timeout is None else time.monotonic() + timeout
            finished = _wait(proc, deadline)
            _kill_group(proc)  # leftover workers, or the whole hung run
        except BaseException:  # Ctrl-C: the child is in another group and did not get it
            _kill_group(proc)
            raise
        finally:
            os.close(life_w)
        if not finished:
            raise IsolationError(
                f"the probe did not finish within {timeout:g} s (--timeout) and was stopped: "
                "a hanging factory, data source or loss_fn?"
            )
        try:
            result: dict[str, Any] = json.loads(res.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise IsolationError(f"the probe process {_death(proc.returncode)}") from None
    if "error" in result:
        raise IsolationError(result["error"], result.get("traceback", ""))
    return result


def run_here(request: dict[str, Any], *, stdout_to_stderr: bool = False) -> dict[str, Any]:
    """:func:`probe_result` in this process (``--in-process``): the same result and one-line
    errors as the child's, without its protection against an exit, a crash or a hang.

    Raises:
        IsolationError: the probe's own error, as the child reports it.
    """
    with contextlib.redirect_stdout(sys.stderr) if stdout_to_stderr else contextlib.nullcontext():
        result = _outcome(request)
    if "error" in result:
        raise IsolationError(result["error"], result.get("traceback", ""))
    return result


# -- child -----------------------------------------------------------------------------------


def _lifeline(fd: int) -> None:
    """End the probe's process group as soon as the parent is gone (its pipe end closes)."""

    def watch() -> None:
        try:
            os.read(fd, 1)
        except OSError:
            pass
        killpg = getattr(os, "killpg", None)
        if killpg is not None:  # this process leads its group: workers go with it
            killpg(0, signal.SIGKILL)
        os._exit(3)

    threading.Thread(target=watch, name="gradwatch-lifeline", daemon=True).start()


def probe_result(request: dict[str, Any]) -> dict[str, Any]:
    """What the child does: load the target, run its watched steps (and ``--overfit``).

    Raises:
        CliError, ConfigError: the target or config is wrong (one line).
    """
    from gradwatch.cli.probe import resolve_config
    from gradwatch.cli.targets import load_target

    probe = load_target(request["target"])
    source = request["config"] if request["config"] is not None else probe.config
    cfg = resolve_config(
        source,
        ignore=request["ignore"],
        fail_on=request["fail_on"],
        warn=request["verbose"],
        select=request["select"],
        ignore_checks=request["ignore_checks"],
    )
    start = time.perf_counter()
    # The probes first, on copies of the model as the factory built it (RNG state restored).
    probed = probe.probes(cfg) if request.get("probes", True) else None
    # watch()'s loss-free probes: the loss-based ones above cover them (or none are wanted)
    report = probe.run(request["steps"], config=cfg.model_copy(update={"probes": "off"}))
    if probed is not None:
        _merge_probes(report, probed)
    if request["curvature"]:
        report.curvature = probe.curvature(samples=request["curvature_samples"])
    losses = probe.overfit(request["overfit_steps"]) if request["overfit"] else None
    return {
        "report": report.model_dump_json(),
        "losses": losses,
        "elapsed": time.perf_counter() - start,
    }


def _merge_probes(report: Any, probed: Any) -> None:
    """The probes' records and findings into the watched steps' report (and its file)."""
    from gradwatch.cli.probe import add_finding

    report.probes = probed.probes
    for finding in probed.findings:
        add_finding(report, finding)
    if not probed.probes:
        return
    # One line per probe: a terminal 80 columns wide shows each whole.
    lines = [
        f"  {p.id} {p.verdict} ({p.seconds:.2f} s{', sampled' if p.sampled else ''})"
        for p in probed.probes
    ]
    print("probes:", *lines, sep="\n", flush=True)
    path = report.config.report_path
    if path is not None:  # the watcher wrote it at exit, without the probes
        report.write(path)


def _outcome(request: dict[str, Any]) -> dict[str, Any]:
    from gradwatch.cli.targets import CliError
    from gradwatch.cli.targets import first_line as _first_line
    from gradwatch.errors import ConfigError

    try:
        return probe_result(request)
    except (CliError, ConfigError) as exc:
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return {"error": line, "traceback": traceback.format_exc()}
    except SystemExit as exc:
        return {
            "error": f"the probe called sys.exit({exc.code!r}) before its steps completed",
            "traceback": traceback.format_exc(),
        }
    except Exception as exc:  # a gradwatch bug: still one line unless --verbose
        return {
            "error": f"internal error: {_first_line(exc)}"
            + ("" if request["verbose"] else " (run with --verbose for the traceback)"),
            "traceback": traceback.format_exc(),
        }


def child_main(argv: list[str]) -> None:
    """Entry point of the child: ``REQUEST RESULT LIFELINE_FD``; never returns."""
    req, res, fd = argv
    if os.name == "posix":  # elsewhere the fd was not passed
        _lifeline(int(fd))
    request = json.loads(Path(req).read_text(encoding="utf-8"))
    sys.path[:] = request["sys_path"]
    result = _outcome(request)
    tmp = Path(f"{res}.tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, res)  # the parent reads a whole result or none
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)  # a stray non-daemon thread must not keep the finished child alive
