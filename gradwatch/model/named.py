"""Several models watched as one: ``watch({"G": netG, "D": netD}, ...)``.

The named models become the children of one :class:`NamedModels` container, registered
under ``"G:"`` so that ``named_modules()`` yields ``"G:"`` and ``"G:.main.0"``;
:func:`~gradwatch.model.engines.clean_name` turns those into ``"G"`` and ``"G:main.0"``. Every
part that walks the watched model (the parameter index, the layer hooks, the forward scout,
the mode watch) then sees all the models at once, and names each parameter with its
model's prefix, ``G:main.0.weight``. The container itself never runs: its children are the
entry points a training loop calls.

Example:
    >>> from torch import nn
    >>> both = NamedModels({"G": nn.Linear(2, 2), "D": nn.Linear(2, 1)})
    >>> [n for n, _ in both.named_parameters()]
    ['G:.weight', 'G:.bias', 'D:.weight', 'D:.bias']
    >>> both.names
    ['G', 'D']
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from gradwatch.errors import ConfigError

__all__ = ["SEP", "NamedModels", "check_name", "entry_points", "member_of"]

SEP = ":"
"""Between a model's name and a parameter's name inside it: ``G:main.0.weight``."""


def check_name(key: object, what: str) -> str:
    """``key`` as a model or optimizer name, or a one-line :class:`ConfigError` naming it."""
    if not isinstance(key, str) or not key or not key.isprintable():
        raise ConfigError(f"{what} names must be non-empty strings, got {key!r}")
    if SEP in key or "." in key or key != key.strip():
        raise ConfigError(
            f"{what} name {key!r} may not hold '{SEP}', '.' or surrounding spaces "
            f"(gradwatch writes parameters as '{key.strip(SEP + '. ') or 'G'}{SEP}layer.weight')"
        )
    return key


class NamedModels(nn.Module):
    """A container of named models, never called itself (see the module docstring)."""

    def __init__(self, models: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.names: list[str] = []
        for key, model in models.items():
            self.add_module(f"{key}{SEP}", model)
            self.names.append(key)

    def model(self, name: str) -> nn.Module:
        """The model watched as ``name``."""
        found = self._modules[f"{name}{SEP}"]
        assert found is not None
        return found

    def forward(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            "gradwatch's NamedModels container is not a model: call the named models themselves"
        )


def entry_points(model: nn.Module) -> list[nn.Module]:
    """The modules a training loop calls: the named models, or the watched model itself."""
    if isinstance(model, NamedModels):
        return [model.model(n) for n in model.names]
    return [model]


def member_of(name: str) -> str:
    """The model a (parameter or layer) name belongs to: ``"G"`` for ``G:main.0.weight``;
    ``""`` for a name without a model prefix."""
    head, sep, _ = name.partition(SEP)
    return head if sep else ""
