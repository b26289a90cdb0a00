"""The model zoo: small, deterministic workloads for tests, benchmarks and examples.

Kept out of the ``autockpt`` package on purpose: these models are user code to autockpt
(its capture watches them as it watches a user's model), and the library does not depend
on them. ``autockpt.zoo`` and ``autockpt.zoo_hf`` re-export them for CLI specs such as
``autockpt.zoo:gpt``.
"""
