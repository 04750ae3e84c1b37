"""The gradient path: per-parameter hooks and state, the backward's end, what a step reads of ``.grad``, one optimizer's window."""
