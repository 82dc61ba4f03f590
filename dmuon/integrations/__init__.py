"""Glue between dmuon and the code people train with: 🤗 Accelerate, the transformers
``Trainer``, torchtitan, Hugging Face MoE models, LeRobot (recipes: docs/integrations.md).
Each module imports its third-party package itself; ``import dmuon`` imports none of them.
"""
