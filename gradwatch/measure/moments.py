"""How much of an Adam-family optimizer's step its ``eps`` decides, from ``exp_avg_sq``.

Adam divides the first moment by ``sqrt(v_hat) + eps``; where ``eps`` is larger than
``sqrt(v_hat)`` the step is ``lr * m / eps``: momentum SGD with learning rate ``lr / eps``.
:func:`eps_dominance` counts, on device, the elements whose second moment has seen a
gradient (``v > 0``) and, of those, the ones where ``eps >= sqrt(v_hat)``: two scalars per
param group, read with the step's one transfer; a large state tensor is read on a strided
sample of 65,536 elements. A quantized state (8-bit optimizers) or an
optimizer without ``exp_avg_sq`` is not measured.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.Adam([p], eps=1.0)
    >>> p.grad = torch.full((3,), 1e-3); opt.step()
    >>> [int(x) for x in eps_dominance(opt, opt.param_groups[0])]
    [3, 3]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

__all__ = ["eps_dominance"]

_SAMPLE = 1 << 16  # elements read per state tensor at most (a strided sample beyond)


def eps_dominance(opt: Any, group: Mapping[str, Any]) -> Optional[torch.Tensor]:
    """``[dominated, measured]`` element counts of ``group`` (``None``: nothing to read)."""
    betas, eps = group.get("betas"), group.get("eps")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or not isinstance(eps, float):
        return None
    beta2 = float(betas[1])
    state = getattr(opt, "state", None)
    if not isinstance(state, Mapping):
        return None
    parts = []
    with torch.no_grad():
        for p in group.get("params", ()):
            st = state.get(p)
            if not isinstance(st, Mapping):
                continue
            v = st.get("exp_avg_sq")
            if not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.numel() == 0:
                continue
            step = st.get("step", 1)
            t = torch.as_tensor(step, dtype=torch.float32).to(v.device)
            bias = 1.0 - torch.pow(torch.tensor(beta2, device=v.device), t)
            flat = v.reshape(-1)
            if flat.numel() > _SAMPLE:  # a strided sample: a view, no copy
                flat = flat[:: -(-flat.numel() // _SAMPLE)]
            # eps >= sqrt(v / bias)  <=>  v <= eps^2 * bias, for v >= 0: no division or sqrt
            small = torch.count_nonzero(flat <= bias * (eps * eps))
            unseen = torch.count_nonzero(flat == 0)
            parts.append(torch.stack([small - unseen, flat.numel() - unseen]).float())
    if not parts:
        return None
    device = parts[0].device
    return torch.stack([x.to(device) for x in parts]).sum(0)
