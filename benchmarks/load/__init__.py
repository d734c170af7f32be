"""Load generation against a running SGLang server: simulated multi-turn users, a streaming client,
metrics, the driver that starts servers at equal KV memory, reports, and the soak test.

Entry point: ``python -m benchmarks.multiturn --help``.
"""
