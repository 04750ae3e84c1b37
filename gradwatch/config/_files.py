"""Reading a config mapping from a file: one parser per format, imported lazily."""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any, Callable

from gradwatch.config._errors import clip
from gradwatch.errors import ConfigError

# A config is a few dozen lines; a bigger file is a mistake (a data file named .yaml), and
# parsing 100 MB of YAML takes minutes.
MAX_CONFIG_BYTES = 1 << 20

# YAML 1.1 (PyYAML) reads ``1e-7`` as a string because it has no dot; YAML 1.2, JSON and
# TOML read it as a number, and so does every user. (The pattern is YAML 1.1's with the dot
# made optional.)
_YAML_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


@functools.cache
def _yaml_loader() -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    return Loader


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: runs no code
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"invalid YAML{where}: {problem}") from None


def _toml(text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python < 3.11 only
        try:
            import tomli as tomllib
        except ImportError:
            raise ValueError(
                "reading TOML on Python < 3.11 needs 'tomli' (pip install tomli)"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"invalid TOML: {exc}") from None


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
        ) from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    ".yaml": _yaml,
    ".yml": _yaml,
    ".toml": _toml,
    ".json": _json,
}


def _read(path: Path) -> str:
    """The file's text: a regular file of at most ``MAX_CONFIG_BYTES``, UTF-8."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):  # a FIFO would block, /dev/zero never end
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"{path}: cannot read config file ({kind})")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror or exc})") from None
    except ConfigError:
        raise
    except ValueError as exc:  # an embedded NUL byte in the path
        raise ConfigError(f"{str(path)!r}: cannot read config file ({exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: config file is larger than {MAX_CONFIG_BYTES >> 20} MiB; "
            "a gradwatch config is a few lines"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})"
        ) from None


def _tool_table(path: Path, data: dict[str, Any]) -> Any:
    """``[tool.gradwatch]`` of a pyproject.toml ({} when absent)."""
    tool = data.get("tool", {})
    if not isinstance(tool, dict):
        raise ConfigError(f"{path}: 'tool' must be a table, not {type(tool).__name__}")
    section = tool.get("gradwatch", {})
    if not isinstance(section, dict):
        raise ConfigError(
            f"{path}: 'tool.gradwatch' must be a table of settings, not {type(section).__name__}"
        )
    return section


def load_mapping(path: Path) -> dict[str, Any]:
    """Parse ``path`` into a dict, with a one-line ``ConfigError`` naming the file on failure."""
    parser = _PARSERS.get(path.suffix.lower())
    if parser is None:
        raise ConfigError(
            f"{path}: unsupported config format {path.suffix!r} (use .yaml, .yml, .toml or .json)"
        )
    text = _read(path)
    try:
        data = parser(text)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a gradwatch config") from None
    except ValueError as exc:  # also int() of a 5000-digit number
        raise ConfigError(f"{path}: {clip(str(exc), 200)}") from None
    if path.name == "pyproject.toml" and isinstance(data, dict):
        data = _tool_table(path, data)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of settings, not {type(data).__name__}"
        )
    return data
