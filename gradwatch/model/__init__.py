"""The model's layout: which parameters there are, what they are called, what wraps them.

The parameter index with every name of a tied tensor and its owning layer (``index.py``),
the wrappers and sharding engines in front of the user's module (``wrappers.py``,
``engines.py``), the real optimizer behind framework wrappers (``optimizers.py``),
``torch.compile`` (``compiled.py``), the registration counter that spares a module walk per
step (``registry.py``) and the source lines a finding points to (``locations.py``).
"""
