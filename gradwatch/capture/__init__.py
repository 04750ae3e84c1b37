"""Capture: the instruments that record what happens in a training loop, and nothing else.

Four kinds, one folder each: ``grads/`` (the gradient path: hooks write evidence into
preallocated per-parameter state, ``evidence.py``, installed and removed by ``hooks.py``; the
step reads arrivals where ``.grad`` says them exactly, ``step_reading.py``; a window,
``window.py``, is one optimizer's parameters between two steps), ``forward/`` (the forward
pass: ``forward_scout.py``, ``nan_probe.py``, modes, autocast), ``loss/`` (what
``Tensor.backward`` is called on: the loss's graph, loose leaves, its terms) and ``loop/``
(the optimizer, GradScaler, schedulers, clipping calls, checkpoints and copies around the
model). What a lower layer sees once is recorded as a fact (``facts.py``) for a check to
judge: capture never writes a finding. The evidence sources (``gradwatch.sources``) put
these instruments to use.
"""
