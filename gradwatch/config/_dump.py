"""The default config written out as YAML: every key, its default, and what it means.

``configs/default.yaml`` is this module's output; ``tests/config/test_config_files.py``
regenerates it and fails when the file is out of date. Each key's comment is its pydantic
``Field`` description (with the values a ``Literal`` allows); each check's entry is headed by
its ``doc`` summary from the registry. Regenerate it after changing a field or a check::

    python -m gradwatch.config._dump configs/default.yaml

Example:
    >>> text = default_yaml()
    >>> "every_n_steps: 10" in text and "  ghost_param:" in text
    True
"""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel

from gradwatch.checks.base import CheckConfig
from gradwatch.checks.registry import by_id
from gradwatch.config import ChecksConfig, GradWatchConfig

__all__ = ["default_yaml"]

WIDTH = 100  # as the code's line length
_HEADER = """\
# gradwatch's default config: every key, its default and what it means. Every key is optional:
# a config file names only what it changes (see configs/ci.yaml).
# Written out from the GradWatchConfig model by `python -m gradwatch.config._dump FILE`;
# tests/config/test_config_files.py fails when this file is out of date.
# JSON Schema for editor completion: `gradwatch schema config > gradwatch-config.schema.json`
"""
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
# Words a YAML 1.1 reader takes for booleans or null: quoted when they are strings.
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "none", "~"}


def _scalar(value: Any) -> str:
    """``value`` as a YAML flow scalar or collection that any YAML reader reads back."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"a default must be finite, not {value!r}")
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        # YAML 1.1 (PyYAML's default loader) reads ``1e-07`` as a string: give it a dot.
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, str):
        plain = _PLAIN.fullmatch(value) and value.lower() not in _YAML_WORDS
        return value if plain else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_scalar(k)}: {_scalar(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no YAML form for a default of type {type(value).__name__}")


def _choices(annotation: Any) -> Optional[list[Any]]:
    """The values a ``Literal`` (or an optional one) allows, else ``None``."""
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    literals = [a for a in typing.get_args(annotation) if typing.get_origin(a) is Literal]
    return list(typing.get_args(literals[0])) if len(literals) == 1 else None


def _comment(text: str, indent: str) -> list[str]:
    return [
        f"{indent}# {line}"
        for line in textwrap.wrap(text, WIDTH - len(indent) - 2, break_on_hyphens=False)
    ]


def _describe(field: Any) -> str:
    text = (field.description or "").strip()
    choices = _choices(field.annotation)
    if choices:
        text = f"{text} One of: {', '.join(_scalar(c) for c in choices)}.".strip()
    return text


def _model(model: type[BaseModel], values: dict[str, Any], indent: str) -> list[str]:
    """The lines of one model's keys: each key with its comment, nested models as blocks."""
    lines: list[str] = []
    common = CheckConfig.model_fields
    for k, (name, field) in enumerate(model.model_fields.items()):
        value = values[name]
        nested = field.annotation
        if model is ChecksConfig:  # a check's entry: headed by what the check finds
            doc = by_id(name).doc
            lines += [*([""] if k else []), *(_comment(doc.summary, indent) if doc else [])]
        elif issubclass(model, CheckConfig) and name in common:
            # ``enabled`` and ``severity`` are described once, above ``checks:``
            if field.description != common[name].description:
                lines += _comment(_describe(field), indent)
        else:
            lines += [*([""] if not indent else []), *_comment(_describe(field), indent)]
        if isinstance(nested, type) and issubclass(nested, BaseModel):
            if nested is ChecksConfig:
                lines += _checks_intro(indent)
            lines.append(f"{indent}{name}:")
            lines += _model(nested, value, indent + "  ")
        else:
            lines.append(f"{indent}{name}: {_scalar(value)}")
    return lines


def _checks_intro(indent: str) -> list[str]:
    """What every check's entry has, said once."""
    return [
        *_comment(
            "One entry per check, headed by what it finds (`gradwatch explain ID` says more). "
            "Every entry has:",
            indent,
        ),
        *(
            f"{indent}#   {name}: {_describe(field)}"
            for name, field in CheckConfig.model_fields.items()
        ),
        f"{indent}# and then the check's own thresholds, if it has any.",
    ]


def default_yaml() -> str:
    """``GradWatchConfig()`` as the text of ``configs/default.yaml``."""
    values = GradWatchConfig().model_dump(mode="json")
    return _HEADER + "\n".join(_model(GradWatchConfig, values, "")) + "\n"


def main(argv: list[str]) -> int:
    """Write the default config to the file named in ``argv`` (or print it)."""
    text = default_yaml()
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
