"""Glue between dmuon and the code people train with (recipes: docs/integrations.md).

Each module imports its third-party package itself; ``import dmuon`` imports none of them.

- :mod:`~dmuon.integrations.accelerate`: ``prepare(accelerator, model, **muon_kwargs)``.
- :mod:`~dmuon.integrations.transformers`: ``DmuonTrainer``, the ``Trainer`` with ``dmuon.Muon``.
- :mod:`~dmuon.integrations.torchtitan`: ``DmuonOptimizersContainer``.
- :mod:`~dmuon.integrations.hf_moe`: expert parallelism for Hugging Face MoE models.
- :mod:`~dmuon.integrations.lerobot`: LeRobot's policies under FSDP2.
"""
