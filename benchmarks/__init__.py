"""Benchmarks: solver speed and quality, budget sweeps over the model zoo."""
