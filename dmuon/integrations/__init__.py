"""Glue between dmuon and the code people train with.

Each module here imports its third-party package lazily: dmuon itself depends on none of them.

- :mod:`dmuon.integrations.hf_moe`: expert parallelism for Hugging Face Mixture-of-Experts
  models (their experts' forward dispatching tokens by all-to-all to the ``"ep"`` rank holding
  each expert).
"""
