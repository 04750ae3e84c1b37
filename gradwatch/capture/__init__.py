"""Capture: the hooks that record what happens in a training loop, and nothing else.

Hooks write evidence into preallocated per-parameter state (``evidence.py``, installed and
removed by ``hooks.py``); the step reads arrivals where ``.grad`` says them exactly
(``step_reading.py``); the forward is scouted (``forward_scout.py``, ``nan_probe.py``); a
window (``window.py``) is one optimizer's parameters between two steps. What a lower layer
sees once is recorded as a fact (``facts.py``) for a check to judge: capture never writes a
finding.
"""
