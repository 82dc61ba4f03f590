"""Glue between dmuon and the code people train with.

Each module here imports its third-party package lazily: dmuon itself depends on none of them
(``import dmuon`` imports no module of this package).

- :mod:`dmuon.integrations.accelerate`: ``model, optimizer = prepare(accelerator, model,
  **muon_kwargs)`` for 🤗 Accelerate's FSDP2 (LeRobot's trainer); the stock loop then runs
  unchanged.
- :mod:`dmuon.integrations.transformers`: ``DmuonTrainer(..., muon_kwargs=dict(...))``, the
  transformers ``Trainer`` with ``dmuon.Muon`` under FSDP2 (imports ``transformers``).
- :mod:`dmuon.integrations.torchtitan`: ``DmuonOptimizersContainer``, torchtitan's optimizer
  container holding ``dmuon.Muon`` (imports ``torchtitan``).
- :mod:`dmuon.integrations.hf_moe`: expert parallelism for Hugging Face Mixture-of-Experts
  models (their experts' forward dispatching tokens by all-to-all to the ``"ep"`` rank holding
  each expert).

docs/integrations.md has a recipe per trainer and what is tested; with dmuon's state-dict and
clipping transparency, no stock call of either trainer goes through dmuon's own functions.
"""
