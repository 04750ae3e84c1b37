"""Measurement: maths on lists of tensors, with no knowledge of models, hooks or checks.

Batched norms grouped by device and dtype with one host transfer (``stats.py``), L1/max/
non-zero count in one pass over large CPU tensors (``chunked.py``), and copy-free
"did it change, by how much" fingerprints taken before a step (``fingerprint.py``).
"""
