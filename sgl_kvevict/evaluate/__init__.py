"""``python -m sgl_kvevict.evaluate``: fidelity to stock of candidate eviction settings on the user's model and
documents, and the flags that meet a fidelity target (docs/before-production.md)."""
