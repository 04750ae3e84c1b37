"""Reading a config mapping from a file: one parser per format, imported lazily."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from gradwatch.errors import ConfigError


def _yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
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


def load_mapping(path: Path) -> dict[str, Any]:
    """Parse ``path`` into a dict, with a one-line ``ConfigError`` naming the file on failure."""
    parser = _PARSERS.get(path.suffix.lower())
    if parser is None:
        raise ConfigError(
            f"{path}: unsupported config format {path.suffix!r} (use .yaml, .yml, .toml or .json)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte {exc.start}: {exc.reason})"
        ) from None
    try:
        data = parser(text)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if path.name == "pyproject.toml" and isinstance(data, dict):
        data = data.get("tool", {}).get("gradwatch", {})
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of settings, not {type(data).__name__}"
        )
    return data
