"""What the benchmarks and ``python -m sgl_kvevict.evaluate`` share: the launcher started and stopped for a
measurement, a streaming client, the chat template, synthetic tasks, intervals and result files."""
