"""Run torchtitan 0.3.0's full ``Trainer`` on CPU gloo ranks, with dmuon or torchtitan's AdamW.

torchtitan's own entry point loads this module as a config registry (``--module``)::

    PYTHONPATH=. torchrun --nproc_per_node 2 -m torchtitan.train \\
        --module bench.torchtitan_cpu_shim --config llama3_debugmodel_cpu \\
        --override.imports dmuon.integrations.torchtitan.muon

``llama3_debugmodel_cpu`` is torchtitan's ``llama3_debugmodel`` with the CPU shims below (its
stock AdamW; dmuon by the one flag above); ``llama3_debugmodel_cpu_dmuon`` adds the three lines a
torchtitan user writes in a config function instead. ``bench/torchtitan_trainer.py`` runs them
and records the exact command lines in ``bench/results/torchtitan_trainer_cpu_2r.json``.

**CPU shims** (every one is for this machine: a user on GPUs with network access needs none):

1. *Device.* With no accelerator torchtitan 0.3.0 still picks ``"cuda"``
   (``_get_available_device_type() or "cuda"``) for its device, meshes, process-group backend,
   memory monitor and profiler. :func:`_use_cpu_device` sets ``device_type = "cpu"`` (so the
   backend is gloo) and a ``device_module`` that answers the few ``torch.cuda`` calls torchtitan
   makes (device name, memory statistics) for the CPU, in each module that imported them.
2. *Attention.* torchtitan's FlexAttention (block-causal per document) has no CPU backward; the
   model uses ``ScaledDotProductAttention`` (causal over the whole sequence, so a token may attend
   to the previous document in its sequence).
3. *Reduction.* FSDP2 reduces gradients with ``PREMUL_SUM``, which gloo lacks; the parallelized
   model is set to ``set_force_sum_reduction_for_comms(True)`` (a plain ``SUM``; torchtitan sets
   the gradient divide factor to 1, so the result is the same).
4. *Data.* There is no network here and torchtitan's wheel has neither its ``c4_test`` dataset
   nor its tokenizer (``tests/assets``). A local dataset ``dmuon_synthetic`` is registered in
   torchtitan's own dataset table (``DATASETS``): 4000 documents of words drawn from a fixed
   random bigram chain (seed 0), so there is something to learn; the tokenizer is bytes
   (:class:`ByteTokenizer`, 256 bytes + BOS + EOS, ids below the model's 2048).
5. *Size.* ``seq_len`` 256 and ``local_batch_size`` 4 instead of 2048 and 8: two shared cores.

Everything else is torchtitan's, with the debug model's settings: ``Trainer``, its
``spmd_types`` backend and FSDP2 ``parallelize_llama`` (bf16 parameters in forward/backward, fp32
reduction), selective activation checkpointing, its chunked cross-entropy loss,
``clip_grad_norm_`` (``training.max_norm`` 1.0), ``LRSchedulersContainer`` (warmup 2, linear
decay), metrics logging and ``CheckpointManager``.
"""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass

import torch

# -- 1. device ---------------------------------------------------------------------------------


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` plus the ``torch.cuda``-only calls torchtitan makes on its device module."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device_module")
        self.memory = types.SimpleNamespace(_record_memory_history=lambda *a, **k: None,
                                            _snapshot=lambda: {})

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_properties(device=None):
        import os
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name=_CpuDeviceModule.get_device_name())

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}  # torchtitan reads .get(key, -1): "no statistics"

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _use_cpu_device() -> None:
    """Point every torchtitan module that bound ``device_type`` / ``device_module`` at the CPU."""
    import torchtitan.components.metrics
    import torchtitan.distributed.parallel_dims
    import torchtitan.distributed.utils
    import torchtitan.tools.profiler
    import torchtitan.tools.utils
    cpu = _CpuDeviceModule()
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu


# -- 2. attention, 3. reduction ----------------------------------------------------------------


def _sdpa_attention(config) -> None:
    """Replace every FlexAttention in ``config.model_spec.model`` by causal SDPA."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())


def _force_sum_reduction(parallelize_fn):
    """``parallelize_fn`` followed by ``set_force_sum_reduction_for_comms(True)`` on every FSDP2
    module (gloo has no ``PREMUL_SUM``)."""

    def parallelize(model, **kwargs):
        model = parallelize_fn(model, **kwargs)
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


# -- 4. data -----------------------------------------------------------------------------------

DATASET = "dmuon_synthetic"


def _synthetic_texts(n_docs: int = 4000, n_words: int = 300, seed: int = 0) -> list[str]:
    """``n_docs`` documents of 20-80 words from a fixed bigram chain over ``n_words`` words."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(n_words)]
    successors = [rng.sample(range(n_words), 4) for _ in range(n_words)]
    docs = []
    for _ in range(n_docs):
        w = rng.randrange(n_words)
        out = []
        for _ in range(rng.randint(20, 80)):
            out.append(words[w])
            w = rng.choice(successors[w])
        docs.append(" ".join(out) + ".")
    return docs


def _register_dataset() -> None:
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS
    DATASETS[DATASET] = DatasetConfig(
        path=DATASET, loader=lambda path: Dataset.from_dict({"text": _synthetic_texts()}),
        sample_processor=lambda sample: sample["text"])


from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as token ids 0-255, BOS 256, EOS 257 (no files needed)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None,
                 **kwargs) -> None:
        super().__init__()
        self.bos_id, self.eos_id = 256, 257

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return 258


# -- the configs -------------------------------------------------------------------------------


def llama3_debugmodel_cpu():
    """torchtitan's ``llama3_debugmodel`` (its AdamW, lr 8e-4, warmup 2, linear decay, max_norm
    1.0, selective AC, checkpoint interval 10) with the CPU shims above."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    _use_cpu_device()
    _register_dataset()
    config = llama3_debugmodel()
    _sdpa_attention(config)
    config.model_spec.parallelize_fn = _force_sum_reduction(config.model_spec.parallelize_fn)
    config.tokenizer = ByteTokenizer.Config()
    config.dataloader.dataset = DATASET
    config.training.seq_len = 256
    config.training.local_batch_size = 4
    return config


def llama3_debugmodel_cpu_dmuon():
    """:func:`llama3_debugmodel_cpu` with dmuon as the optimizer: the three lines a torchtitan
    user adds to a config function (Muon lr 0.02 on the matrices, AdamW at torchtitan's 8e-4
    on the rest with its betas (0.9, 0.95), weight decay 0.1 for both)."""
    config = llama3_debugmodel_cpu()
    from dmuon.integrations.torchtitan import DmuonOptimizersContainer
    config.optimizer = DmuonOptimizersContainer.Config(
        muon_kwargs=dict(lr=0.02, adamw_lr=8e-4, adamw_betas=(0.9, 0.95), weight_decay=0.1))
    return config
