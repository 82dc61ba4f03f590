"""Attention modules dmuon recognizes, and which projection-weight rows hold each head, for
per-head Muon (:mod:`dmuon.owners.blocks`) and QK-clip (:mod:`dmuon.qk_clip`): Hugging Face
``q_proj``/``k_proj``/``v_proj``, ``nn.MultiheadAttention``'s ``in_proj_weight`` ``[q; k; v]``,
torchtitan's ``wq``/``wk``/``wv`` and KV-group-major ``wqkv`` (``[n_kv, heads_per_kv + 2,
head_dim, dim]``, ``FusedQKVLinear._split_qkv_on_save``), timm's ``qkv`` and ``q`` + ``kv``
pairs. Query head ``h`` uses key head ``h // (num_heads / num_kv_heads)`` (``repeat_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_local_heads")


@dataclass(frozen=True, slots=True)
class WeightRef:
    """A projection weight ``module._parameters[attr]`` of ``rows`` full rows: ``head_rows`` the
    first of each head's ``head_dim`` rows, in head order; ``bias`` the attribute of its bias on
    ``module``, or ``None``."""

    module: nn.Module
    attr: str
    rows: int
    head_rows: tuple[int, ...]
    head_dim: int
    bias: str | None = None


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """One attention module (``name`` in the model; hooks go on ``module``), its head counts,
    query/key rows per head, projections ``q``/``k``/``v`` and QK-norm children (or ``None``)."""

    name: str
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q: WeightRef
    k: WeightRef
    v: WeightRef
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    @property
    def group(self) -> int:
        """Query heads per key head."""
        return self.num_heads // self.num_kv_heads


def _int_attr(objs: list[Any], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _rows(module: nn.Module, full_rows: dict, attr: str = "weight") -> int | None:
    if (id(module), attr) in full_rows:
        return int(full_rows[(id(module), attr)])
    w = getattr(module, attr, None)
    shape = getattr(w, "_dmuon_shape", None) or (tuple(w.shape) if w is not None else None)
    return int(shape[0]) if shape else None


def _check(name: str, what: str, rows: int | None, expected: int) -> None:
    if rows != expected:
        raise ValueError(
            f"dmuon: attention module {name!r}: its {what} has {rows} rows, but its head counts "
            f"say {expected}; give the split explicitly with split={{...: dmuon.Split(...)}} or "
            f"leave per_head / qk_clip_threshold off.")


def _ref(module: nn.Module, rows: int, first: int, heads: int, dim: int, attr: str = "weight",
         bias: str = "bias") -> WeightRef:
    """``heads`` heads of ``dim`` rows each, back to back from row ``first``."""
    return WeightRef(module, attr, rows, tuple(first + h * dim for h in range(heads)), dim,
                     bias if getattr(module, bias, None) is not None else None)


def _separate(name: str, module: nn.Module, q: nn.Module, k: nn.Module, v: nn.Module,
              extra: list[Any], full_rows: dict) -> AttentionLayout | None:
    sources = [s for s in (module, *extra, getattr(module, "config", None)) if s is not None]
    heads = _int_attr(sources, _HEADS)
    q_rows, k_rows, v_rows = (_rows(m, full_rows) for m in (q, k, v))
    if heads is None or q_rows is None:
        return None
    kv = _int_attr(sources, _KV_HEADS) or heads
    dim = _int_attr(sources, ("head_dim",)) or q_rows // heads
    _check(name, "query projection", q_rows, heads * dim)
    _check(name, "key projection", k_rows, kv * dim)
    if heads % kv or not v_rows or v_rows % kv:
        raise ValueError(f"dmuon: attention module {name!r}: {heads} query heads, {kv} key/value "
                         f"heads and {v_rows} value rows do not group evenly.")
    return AttentionLayout(name, module, heads, kv, dim, _ref(q, q_rows, 0, heads, dim),
                           _ref(k, k_rows, 0, kv, dim), _ref(v, v_rows, 0, kv, v_rows // kv))


def _fused_qkv(name: str, module: nn.Module, qkv: nn.Linear, full_rows: dict) -> AttentionLayout | None:
    """``qkv`` ``[3 * heads * head_dim, dim]`` laid out ``[q; k; v]`` (timm ``Attention``)."""
    heads, rows = _int_attr([module], _HEADS), _rows(qkv, full_rows)
    if heads is None or rows is None or rows % (3 * heads):
        return None
    dim = _int_attr([module], ("head_dim",)) or rows // (3 * heads)
    _check(name, "fused qkv", rows, 3 * heads * dim)
    q, k, v = (_ref(qkv, rows, i * heads * dim, heads, dim) for i in range(3))
    return AttentionLayout(name, module, heads, heads, dim, q, k, v)


def _q_kv(name: str, module: nn.Module, q: nn.Linear, kv: nn.Linear,
          full_rows: dict) -> AttentionLayout | None:
    """``q`` ``[heads * head_dim, dim]`` and a fused ``kv`` ``[2 * kv_heads * head_dim, dim]``
    laid out ``[k; v]`` (dmuon.train's policy: one shared key/value head)."""
    heads, dim = _int_attr([module], _HEADS), _int_attr([module], ("head_dim",))
    q_rows, kv_rows = _rows(q, full_rows), _rows(kv, full_rows)
    if heads is None or q_rows is None or kv_rows is None:
        return None
    dim = dim or q_rows // heads
    _check(name, "query projection", q_rows, heads * dim)
    kv_heads = _int_attr([module], _KV_HEADS) or kv_rows // (2 * dim)
    _check(name, "fused kv", kv_rows, 2 * kv_heads * dim)
    if kv_heads < 1 or heads % kv_heads:
        return None
    k, v = (_ref(kv, kv_rows, i * kv_heads * dim, kv_heads, dim) for i in range(2))
    return AttentionLayout(name, module, heads, kv_heads, dim, _ref(q, q_rows, 0, heads, dim), k, v)


def _fused_group_major(name: str, module: nn.Module, wqkv: nn.Linear, sources: list[Any],
                       full_rows: dict) -> AttentionLayout | None:
    heads, dim = _int_attr(sources, _HEADS), _int_attr(sources, ("head_dim",))
    rows = _rows(wqkv, full_rows)
    if heads is None or dim is None or rows is None:
        return None
    kv = _int_attr(sources, _KV_HEADS) or heads
    _check(name, "fused wqkv", rows, (heads + 2 * kv) * dim)
    per = heads // kv  # heads_per_kv; each group holds per + 2 head blocks
    bias = "bias" if wqkv.bias is not None else None
    q_rows = tuple(((h // per) * (per + 2) + h % per) * dim for h in range(heads))
    k_rows = tuple((g * (per + 2) + per) * dim for g in range(kv))
    q, k, v = (WeightRef(wqkv, "weight", rows, r, dim, bias)
               for r in (q_rows, k_rows, tuple(r + dim for r in k_rows)))
    return AttentionLayout(name, module, heads, kv, dim, q, k, v)


def _projections(name: str, module: nn.Module, full_rows: dict) -> AttentionLayout | None:
    if isinstance(module, nn.MultiheadAttention):
        if not module._qkv_same_embed_dim or module.in_proj_weight is None:
            return None
        heads, dim, e = module.num_heads, module.head_dim, module.embed_dim
        q, k, v = (_ref(module, 3 * e, i * e, heads, dim, "in_proj_weight", "in_proj_bias") for i in range(3))
        return AttentionLayout(name, module, heads, heads, dim, q, k, v)
    children = dict(module.named_children())
    if all(isinstance(children.get(n), nn.Linear) for n in ("q_proj", "k_proj", "v_proj")):
        return _separate(name, module, children["q_proj"], children["k_proj"], children["v_proj"], [],
                         full_rows)
    if isinstance(children.get("qkv"), nn.Linear):  # timm / ViT: one [q; k; v] Linear
        return _fused_qkv(name, module, children["qkv"], full_rows)
    if isinstance(children.get("q"), nn.Linear) and isinstance(children.get("kv"), nn.Linear):
        return _q_kv(name, module, children["q"], children["kv"], full_rows)
    # torchtitan: the projections sit on the attention module or on its ``qkv_linear`` child
    for holder, extra in ((module, []), (children.get("qkv_linear"), [module])):
        if holder is None:
            continue
        parts = dict(holder.named_children())
        if all(isinstance(parts.get(n), nn.Linear) for n in ("wq", "wk", "wv")):
            return _separate(name, module, parts["wq"], parts["wk"], parts["wv"], [holder] + extra, full_rows)
        if isinstance(parts.get("wqkv"), nn.Linear):
            return _fused_group_major(name, module, parts["wqkv"], [holder, module], full_rows)
    return None


def find_attention(model: nn.Module, records: Any = ()) -> list[AttentionLayout]:
    """Every attention module of ``model`` dmuon recognizes, in module order (no match inside a
    match), with its ``q_norm`` / ``k_norm`` children (``nn.Identity`` counts as none).

    ``records``: the dedicated records, whose ``full_shape`` gives a weight's rows (a module
    holds a TP slice or a placeholder). ValueError for head counts that do not match the rows.
    """
    full_rows = {(id(r.module), r.attr): r.full_shape[0] for r in records}
    found: list[AttentionLayout] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        layout = None if id(module) in inside else _projections(name, module, full_rows)
        if layout is None:
            continue
        children = dict(module.named_children())
        norms = [children.get(n) for n in ("q_norm", "k_norm")]
        norms = [None if n is None or isinstance(n, nn.Identity) else n for n in norms]
        found.append(replace(layout, q_norm=norms[0], k_norm=norms[1]) if any(norms) else layout)
        inside.update(id(m) for m in module.modules())
    return found
