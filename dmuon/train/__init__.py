"""The main job: a Pi0-style policy trained on PushT demonstrations (``python -m dmuon.train``).

Modules: :mod:`~dmuon.train.expert` (scripted PushT expert), :mod:`~dmuon.train.data`
(demonstrations, cache, batches), :mod:`~dmuon.train.model` (the policy),
:mod:`~dmuon.train.loop` (one rank's training), :mod:`~dmuon.train.launch` (CLI, spawn/torchrun),
:mod:`~dmuon.train.ckpt` (``--save`` checkpoints, loading a plain policy),
:mod:`~dmuon.train.eval` (closed-loop PushT rollouts, ``python -m dmuon.train.eval``).
"""
