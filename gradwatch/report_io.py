"""Writing report files safely: atomic, through symlinks, never onto a device or a FIFO.

Every output file gradwatch writes (the JSON report, JUnit XML, HTML) goes through
:func:`write_text_atomic`: the text is written to a temporary file in the target's own
folder and renamed over the target, so a full disk or a crash leaves the previous file
whole. A symlink is followed (its target is updated, the link stays), except where the
kernel's ``fs.protected_symlinks`` would refuse to follow it: a link in a sticky
world-writable folder (``/tmp``) owned by neither the writer nor the folder's owner (another
user's link there, aimed at a file of yours or, as root, at any file). A target that exists
and is not a regular file (``/dev/stdout``, ``/dev/full``, a FIFO, a folder) is refused with
a one-line :class:`~gradwatch.errors.ConfigError` instead of being replaced (as root, a
rename would replace the device node itself).

Example:
    >>> from gradwatch.report_io import write_text_atomic
    >>> write_text_atomic("out/report.json", "{}")  # doctest: +SKIP
    PosixPath('out/report.json')
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from gradwatch.errors import ConfigError

if TYPE_CHECKING:
    from gradwatch.results import ReportData as Report

__all__ = ["check_report_path", "resolve_output", "write_text_atomic", "write_watched_report"]

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def resolve_output(path: Union[str, Path], *, what: str = "output") -> Path:
    """The file that writing ``path`` must replace: symlinks followed, non-regular refused.

    Raises:
        ConfigError: ``path`` holds a NUL byte, exists and is not a regular file (or a
            symlink to one), or goes through another user's link in a sticky folder.
        OSError: the path cannot be looked at (a name too long, a loop of links).
    """
    text = os.fspath(path)
    if "\x00" in text:
        raise ConfigError(f"{what} path {text!r} contains a NUL byte")
    try:
        _follow_links(text, what)
        st: Optional[os.stat_result] = os.stat(text)  # follows links as the kernel does
    except FileNotFoundError:
        st = None  # a new file, or a dangling symlink whose target gets created
    except NotADirectoryError:
        raise ConfigError(f"cannot write {what} {text!r}: a parent is not a directory") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        hint = " (use '-' for standard output where the option allows it)"
        raise ConfigError(
            f"cannot write {what} {text!r}: it is {_kind(st.st_mode)}, not a regular file"
            + (hint if stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) else "")
        )
    real = Path(os.path.realpath(text))
    if st is not None and os.fspath(real) != os.path.abspath(text):
        _same_file(text, real, st, what)
    return real


def _follow_links(text: str, what: str) -> None:
    """Resolve ``text`` link by link as the kernel does, refusing the links that
    ``fs.protected_symlinks`` refuses to follow (see :func:`_protected`).

    The write itself renames a temporary file over the resolved target, which no kernel
    check sees: the rule is applied here. A part that does not exist ends the walk.
    """
    parts = text.split(os.sep)
    here = os.sep if os.path.isabs(text) else os.getcwd()
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            here = os.path.dirname(here)
            continue
        path = os.path.join(here, part)
        st = os.lstat(path)  # FileNotFoundError: the rest is to be created
        if not stat.S_ISLNK(st.st_mode):
            here = path
            continue
        hops += 1
        if hops > 40:  # as the kernel's ELOOP
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        if _protected(here, st):
            raise ConfigError(
                f"cannot write {what} {text!r}: {path!r} is another user's symlink in a "
                "sticky world-writable folder; not followed (as fs.protected_symlinks does)"
            )
        target = os.readlink(path)
        parts = target.split(os.sep) + parts
        if os.path.isabs(target):
            here = os.sep


def _protected(folder: str, link: os.stat_result) -> bool:
    """The kernel's rule: a link in a sticky, world-writable folder is followed only by its
    owner or when the folder's owner owns it too."""
    if not hasattr(os, "geteuid"):  # no such rule where there are no uids (Windows)
        return False
    st = os.stat(folder)
    sticky_shared = st.st_mode & stat.S_ISVTX and st.st_mode & stat.S_IWOTH
    return bool(sticky_shared) and link.st_uid not in (os.geteuid(), st.st_uid)


def _same_file(text: str, real: Path, st: os.stat_result, what: str) -> None:
    """``real`` (``text`` with its links resolved) names the file ``text`` opens.

    ``/proc/self/fd/N`` and similar "magic" links resolve to names that are not the file. A
    path without links needs no test; with links, another writer's rename between two stats
    changes the inode (concurrent writers to one report), so a mismatch is looked at again.
    """
    for _ in range(8):
        try:
            real_st: Optional[os.stat_result] = os.stat(real)
        except FileNotFoundError:
            real_st = None
        if real_st is not None and (real_st.st_dev, real_st.st_ino) == (st.st_dev, st.st_ino):
            return
        try:
            st = os.stat(text)
        except FileNotFoundError:
            return  # replaced by nothing yet: written as a new file
        if os.path.realpath(text) != os.fspath(real):
            break
    raise ConfigError(f"cannot write {what} {text!r}: cannot resolve it to a file path")


def write_text_atomic(path: Union[str, Path], text: str, *, what: str = "output") -> Path:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, then rename).

    Parent folders are created. A symlink's target is updated; an existing file keeps its
    permission bits; a new one gets ``0666 & ~umask``, as ``open()`` would give it.

    Returns:
        ``path`` as given.

    Raises:
        ConfigError: ``path`` is not a regular file (see :func:`resolve_output`).
        OSError: the write failed (full disk, permissions); the old file is untouched.
    """
    real = resolve_output(path, what=what)
    real.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(real).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
    try:
        # A lone surrogate that reached the text (a name from os.fsdecode) is written as its
        # escape rather than failing the whole file.
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())  # the rename must not land before the data does
        os.chmod(tmp, mode)  # mkstemp makes it 0600; a report is for reading
        os.replace(tmp, real)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(path)


def check_report_path(path: Optional[Union[str, Path]]) -> None:
    """Fail now, not at the end of training, when ``report_path`` cannot be written.

    It is refused when it is not a regular file, or when its folder cannot be created or
    cannot take a new file (what :func:`write_text_atomic` needs). Nothing is left behind
    but the folder.

    Raises:
        ConfigError: one line naming the path and the reason.
    """
    if path is None:
        return
    try:
        real = resolve_output(path, what="report_path")
        real.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".tmp", dir=real.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(
            f"report_path {os.fspath(path)!r} cannot be written: {exc.strerror or exc}"
        ) from None


def write_watched_report(report: Report, path: Union[str, Path]) -> Path:
    """``report.write(path)`` for the watcher (refreshes and exit): a path that went bad during
    the run is a contained fault (``OSError``), not a ``ConfigError`` raised into training."""
    try:
        return write_text_atomic(path, report.model_dump_json(indent=2), what="JSON report")
    except ConfigError as exc:
        raise OSError(errno.EINVAL, str(exc)) from None
