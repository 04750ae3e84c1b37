"""The receptive field a forward's ops can make, read from the ops themselves.

:class:`OpLog` is a ``TorchFunctionMode`` entered for the model's forward only (a pre-hook and
a hook on the root module; ``loss_fn``'s reductions are not the model's). Each op is one of:

- **reach-all**: attention (``scaled_dot_product_attention``, ``multi_head_attention_forward``,
  a product of two batched activations), recurrence (the ``lstm``/``gru``/``rnn`` kernels and
  cells), global or adaptive pooling, group and instance norm, reductions, softmaxes and
  cumulative ops over a position dimension, sorting, flips and rolls, data-dependent indexing
  (``gather``, ``index_select``, a tensor index), circular padding, FFTs, and a linear map over
  a last dimension that a reshape merged from positions, three or more slices concatenated or
  stacked along a position dimension (a loop over positions): any input position may reach any
  output position, and the probe does not judge that model;
- **bounded**: convolutions and local pooling (``(k - 1) * dilation`` times the stride so far),
  slicing, concatenation, pixel shuffles and interpolation (their shift; padding only shifts,
  and the window around an output position is the field on both sides);
- **pointwise**: every other op (elementwise maths, a linear map on the features).

Reshapes (``view``, ``reshape``, ``flatten``, ``unflatten``) are recorded with the line that
called them. One that regroups the dimensions beside the batch (neither merging adjacent
dimensions nor splitting one: ``x.view(B, L, C)`` of a ``(B, C, L)`` tensor) is named when the
measured dependence outreaches the field: it is what puts a channel where a position was.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["OpLog", "Reshape", "regroups"]

_RNN = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell")
_GLOBAL = {
    "scaled_dot_product_attention",
    "multi_head_attention_forward",
    *_RNN,
    "rnn_relu_cell",
    "group_norm",
    "instance_norm",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "logcumsumexp",
    "sort",
    "argsort",
    "msort",
    "topk",
    "kthvalue",
    "median",
    "nanmedian",
    "roll",
    "flip",
    "fliplr",
    "flipud",
    "gather",
    "index_select",
    "take_along_dim",
    "take",
    "scatter",
    "scatter_add",
    "scatter_reduce",
    "index_add",
    "index_copy",
    "grid_sample",
    "embedding_bag",
    "masked_select",
    "nonzero",
    "unique",
    "cdist",
}
_GLOBAL_PREFIX = ("adaptive_", "fft_", "rfft", "irfft", "ifft", "hfft")
_REDUCE = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "std",
    "var",
    "norm",
    "logsumexp",
    "softmax",
    "log_softmax",
    "prod",
    "std_mean",
    "var_mean",
    "nansum",
    "nanmean",
    "vector_norm",
    "argmax",
    "argmin",
    "count_nonzero",
    "any",
    "all",
}
_PRODUCTS = {"matmul", "__matmul__", "bmm", "baddbmm", "einsum", "tensordot"}
_CONV = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
_POOL = ("max_pool", "avg_pool", "lp_pool", "fractional_max_pool", "unfold", "fold")
_RESHAPE = {"view", "reshape", "flatten", "unflatten"}


@dataclass
class Reshape:
    """One reshape of an activation: its shapes, whether it regroups, and who called it."""

    op: str
    before: tuple[int, ...]
    after: tuple[int, ...]
    line: str
    regroup: bool


@dataclass(eq=False)
class OpLog(TorchFunctionMode):
    """What one forward's ops can connect along its positions (see the module docstring)."""

    reach_all: list[str] = field(default_factory=list)  # the first reach-all ops, named
    field_size: float = 1.0  # the receptive field along any position axis, in input steps
    stride: float = 1.0  # the stride so far (input steps per step)
    convolutional: bool = False  # a conv or pool ran: dimension 1 is the channels
    merged: set[int] = field(default_factory=set)  # last-dim sizes merged from positions
    channels: set[int] = field(default_factory=set)  # sizes of channel and feature dims
    reshapes: list[Reshape] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def _global(self, what: str) -> None:
        if len(self.reach_all) < 8 and what not in self.reach_all:
            self.reach_all.append(what)

    def _grow(self, kernel: int, dilation: int = 1, stride: int = 1) -> None:
        self.field_size += max(kernel - 1, 0) * max(dilation, 1) * self.stride
        self.stride *= max(stride, 1)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._read(getattr(func, "__name__", ""), args, kwargs, out)
        except Exception:  # reading an op must never break the forward it watches
            self._global(f"{getattr(func, '__name__', func)} (unread)")
        return out

    def _read(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if name in _GLOBAL or name.startswith(_GLOBAL_PREFIX):
            self._global(name)
        elif name in _REDUCE and x is not None:
            self._reduce(name, x, args, kwargs)
        elif name in _PRODUCTS:
            self._product(name, args)
        elif name == "linear" and x is not None and x.dim() >= 1:
            self.channels |= {int(x.shape[-1]), *(int(d) for d in args[1].shape[:1])}
            if x.shape[-1] in self.merged:
                self._global("linear over a dimension merged from positions")
        elif name.startswith(_CONV) and len(args) > 1 and isinstance(args[1], Tensor):
            self.convolutional = True
            self.channels |= {int(args[1].shape[0]), int(args[1].shape[1])}
            if x is not None and x.dim() >= 2:
                self.channels.add(int(x.shape[1]))
            self._conv(name, args, kwargs)
        elif name == "unfold" and len(args) >= 4 and all(isinstance(a, int) for a in args[1:4]):
            self._grow(args[2], 1, args[3])  # Tensor.unfold(dim, size, step): sliding windows
        elif name.startswith(_POOL):
            self.convolutional = True
            kernel = _first_int(args[1] if len(args) > 1 else kwargs.get("kernel_size", 1))
            stride = kwargs.get("stride", args[2] if len(args) > 2 else None)
            self._grow(kernel, _first_int(kwargs.get("dilation", 1)), _first_int(stride or kernel))
        elif name == "pad":
            self._pad(args, kwargs)
        elif name in ("pixel_shuffle", "pixel_unshuffle", "interpolate", "upsample"):
            self._grow(3)
        elif name == "__getitem__":
            self._index(args)
        elif name in ("cat", "concat", "concatenate", "stack"):
            self._cat(name, args, kwargs)
        elif name in _RESHAPE and x is not None and isinstance(out, Tensor):
            self._reshape(name, x, out)

    def _reduce(self, name: str, x: Tensor, args: tuple, kwargs: dict) -> None:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if isinstance(dim, Tensor):  # torch.max(a, b): elementwise
            return
        if dim is None:
            if x.dim() > 1:
                self._global(f"{name} over every dimension")
            return
        dims = [dim] if isinstance(dim, int) else list(dim)
        for d in dims:
            d = d % max(x.dim(), 1)
            last = d == x.dim() - 1 and (not self.convolutional or x.shape[d] in self.channels)
            local = d == 0 or last or (self.convolutional and d == 1) or x.dim() <= 2
            if not local:
                self._global(f"{name} over dimension {d} of {tuple(x.shape)}")

    def _product(self, name: str, args: tuple) -> None:
        tensors = [a for a in args if isinstance(a, Tensor)]
        if name == "einsum" and len(args) > 1 and isinstance(args[1], (list, tuple)):
            tensors = [a for a in args[1] if isinstance(a, Tensor)]
        batched = [t for t in tensors if t.dim() >= 3 and not isinstance(t, nn.Parameter)]
        if len(batched) >= 2:
            self._global(f"{name} of two activations (attention)")
        elif any(t.dim() >= 1 and t.shape[-1] in self.merged for t in tensors[:1]):
            self._global(f"{name} over a dimension merged from positions")

    def _conv(self, name: str, args: tuple, kwargs: dict) -> None:
        weight = args[1]
        kernel = max(weight.shape[2:], default=1)
        stride = _first_int(kwargs.get("stride", args[3] if len(args) > 3 else 1))
        dilation = _first_int(kwargs.get("dilation", args[5] if len(args) > 5 else 1))
        if "transpose" in name:  # upsampling: later steps are finer, the field grows by k
            self._grow(kernel * max(stride, 1), dilation)
            self.stride /= max(stride, 1)
        else:
            self._grow(kernel, dilation, stride)

    def _pad(self, args: tuple, kwargs: dict) -> None:
        mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
        if mode == "circular":
            self._global("circular padding")
        # Zero, reflect or replicate padding only shifts positions (the measured window is
        # centred on the output position scaled to the input, with the field on both sides).

    def _index(self, args: tuple) -> None:
        index = args[1] if len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if isinstance(item, Tensor) and item.dtype != bool and item.dim() > 0:
                self._global("indexing with a tensor")
            elif isinstance(item, slice):
                shift = max(
                    abs(item.start or 0), abs(item.stop or 0) if (item.stop or 0) < 0 else 0
                )
                self.field_size += shift * self.stride
                self.stride *= abs(item.step or 1)

    def _cat(self, name: str, args: tuple, kwargs: dict) -> None:
        parts = args[0] if args else kwargs.get("tensors", ())
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        tensors = [t for t in parts if isinstance(t, Tensor)]
        if not tensors or not isinstance(dim, int):
            return
        ndim = tensors[0].dim() + (1 if name == "stack" else 0)
        d = dim % max(ndim, 1)
        if d == 0 or d == ndim - 1 or (self.convolutional and d == 1):
            return
        if len(tensors) > 2:  # slices put back together: a loop over positions (a recurrence)
            self._global(f"{name} of {len(tensors)} slices along dimension {d}")
        elif name != "stack":
            self.field_size += sum(t.shape[d] for t in tensors[:-1]) * self.stride

    def _reshape(self, name: str, x: Tensor, out: Tensor) -> None:
        before, after = tuple(x.shape), tuple(out.shape)
        if before == after or x.dim() == 0:
            return
        regroup = regroups(before, after)
        if out.dim() >= 1 and len(before) > out.dim() and out.shape[-1] not in before[-1:]:
            self.merged.add(int(out.shape[-1]))
        if regroup or len(self.reshapes) < 32:
            self.reshapes.append(Reshape(name, before, after, _caller(), regroup))


def regroups(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether a reshape regroups the dimensions after the first: some run of dimensions with
    equal products holds two or more (non-1) dimensions on both sides, as when a ``(C, L)``
    block becomes ``(L, C)``, rather than merging some into one or splitting one."""
    old = [d for d in before[1:] if d != 1]
    new = [d for d in after[1:] if d != 1]
    if not before or not after or before[0] != after[0]:
        old, new = [d for d in before if d != 1], [d for d in after if d != 1]
    i = j = 0
    while i < len(old) and j < len(new):
        a, b, ni, nj = old[i], new[j], 1, 1
        while a != b:
            if a < b and i + ni < len(old):
                a *= old[i + ni]
                ni += 1
            elif b < a and j + nj < len(new):
                b *= new[j + nj]
                nj += 1
            else:
                return False
        if ni > 1 and nj > 1:
            return True
        i, j = i + ni, j + nj
    return False


def _first_int(value: Any) -> int:
    if isinstance(value, (tuple, list)):
        return max((int(v) for v in value), default=1)
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def _caller() -> str:
    """The first frame outside torch and gradwatch: the user's line that called the op."""
    frame: Optional[Any] = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and "/gradwatch/" not in path:
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "unknown"
