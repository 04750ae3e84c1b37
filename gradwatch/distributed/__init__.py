"""Ranks and shards: one step's evidence made global with at most one collective.

The arrival codes and shard statistics of every rank ride on one ``all_gather``
(``sync.py``); sharded engines read local shards (``sharded.py``, ``gather.py``; FSDP1's
flattened parameters in ``fsdp1_flat.py``), and what an engine hides is recorded as a fact
(``layout.py``).
"""
