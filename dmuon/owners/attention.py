"""Attention modules dmuon recognizes, and where their heads live in the projection weights.

The one place per-head Muon (:mod:`dmuon.owners.blocks`) and QK-clip (:mod:`dmuon.qk_clip`)
read which weight rows belong to which head. Layouts recognized:

* Hugging Face ``transformers`` (Llama, Qwen, Gemma, SigLIP, ... ``*Attention`` with
  ``q_proj`` / ``k_proj`` / ``v_proj``): head counts from the module (``num_heads``,
  ``num_key_value_heads``, ``head_dim``) or its ``config`` (``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``);
* ``torch.nn.MultiheadAttention`` with one ``in_proj_weight`` ``[3E, E]`` (fused ``[q; k; v]``);
* torchtitan's llama3 (``wq`` / ``wk`` / ``wv`` with ``n_heads`` / ``n_kv_heads`` / ``head_dim``)
  and its fused ``FusedQKVLinear`` (``wqkv`` laid out KV-group-major, ``[n_kv, heads_per_kv + 2,
  head_dim, dim]``: each group's query heads, then its key head, then its value head; torchtitan
  ``FusedQKVLinear._split_qkv_on_save``);
* a ``qkv`` ``Linear`` laid out ``[q; k; v]`` with ``num_heads`` / ``heads`` (timm's ViT
  ``Attention``, dmuon.train's vision blocks), and ``q`` + ``kv`` (``[k; v]``) ``Linear`` pairs
  (dmuon.train's backbone and action-expert blocks).

Query head ``h`` uses key head ``h // (num_heads / num_kv_heads)`` (grouped-query attention as
``transformers``' ``repeat_kv`` and ``F.scaled_dot_product_attention(enable_gqa=True)``).

A projection's bias has its weight's rows (:attr:`WeightRef.bias`); ``q_norm`` / ``k_norm``
children (Qwen3, Gemma 3, OLMo 2) are recorded on the layout (``nn.Identity`` counts as none).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_local_heads")


@dataclass(frozen=True, slots=True)
class WeightRef:
    """A projection weight: ``module._parameters[attr]`` (a dedicated record's slot), and the
    first row of each head in it.

    Attributes:
        module: the module holding the weight (a ``Linear``, or the attention module itself).
        attr: the parameter's attribute name.
        head_rows: first row of each head's ``head_dim`` rows, in head order.
        head_dim: rows per head.
        bias: the attribute name of the projection's bias on ``module`` (same rows as the
            weight: ``bias`` of a ``Linear``, ``in_proj_bias`` of ``nn.MultiheadAttention``);
            ``None`` when it has none.
    """

    module: nn.Module
    attr: str
    head_rows: tuple[int, ...]
    head_dim: int
    bias: str | None = None


@dataclass(frozen=True, slots=True)
class AttentionLayout:
    """One attention module and its projections.

    Attributes:
        name: the module's name in the model.
        module: the module whose forward computes the attention (hooks go here).
        num_heads: query heads.
        num_kv_heads: key/value heads (``num_heads`` without grouped-query attention).
        head_dim: query/key rows per head.
        q, k, v: the projections' weights and head rows (``v`` may be ``None``).
        q_norm, k_norm: the module's ``q_norm`` / ``k_norm`` children (a QK-norm applied to the
            projections' output before the logits), ``None`` where it has none.
    """

    name: str
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q: WeightRef
    k: WeightRef
    v: WeightRef | None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    @property
    def group(self) -> int:
        """Query heads per key head."""
        return self.num_heads // self.num_kv_heads


def _bias(module: nn.Module, attr: str = "bias") -> str | None:
    """``attr`` when ``module`` has a bias parameter there, else ``None``."""
    return attr if getattr(module, attr, None) is not None else None


def _with_norms(layout: AttentionLayout | None) -> AttentionLayout | None:
    """``layout`` with the attention module's ``q_norm`` / ``k_norm`` children (``nn.Identity``:
    none)."""
    if layout is None:
        return None
    children = dict(layout.module.named_children())
    norms = [children.get(n) for n in ("q_norm", "k_norm")]
    norms = [None if n is None or isinstance(n, nn.Identity) else n for n in norms]
    return replace(layout, q_norm=norms[0], k_norm=norms[1]) if any(norms) else layout


def _int_attr(objs: list[Any], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _rows(module: nn.Module, attr: str = "weight", full_rows: Any = None) -> int | None:
    if full_rows and (id(module), attr) in full_rows:
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


def _separate(name: str, module: nn.Module, q: nn.Module, k: nn.Module, v: nn.Module,
              extra: list[Any], full_rows: Any = None) -> AttentionLayout | None:
    sources = [module, *extra, getattr(module, "config", None)]
    sources = [s for s in sources if s is not None]
    heads = _int_attr(sources, _HEADS)
    q_rows, k_rows, v_rows = (_rows(m, full_rows=full_rows) for m in (q, k, v))
    if heads is None or q_rows is None:
        return None
    kv = _int_attr(sources, _KV_HEADS) or heads
    head_dim = _int_attr(sources, ("head_dim",)) or q_rows // heads
    _check(name, "query projection", q_rows, heads * head_dim)
    _check(name, "key projection", k_rows, kv * head_dim)
    if heads % kv or not v_rows or v_rows % kv:
        raise ValueError(f"dmuon: attention module {name!r}: {heads} query heads, {kv} key/value "
                         f"heads and {v_rows} value rows do not group evenly.")
    v_dim = v_rows // kv
    return AttentionLayout(
        name=name, module=module, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        q=WeightRef(q, "weight", tuple(h * head_dim for h in range(heads)), head_dim, _bias(q)),
        k=WeightRef(k, "weight", tuple(h * head_dim for h in range(kv)), head_dim, _bias(k)),
        v=WeightRef(v, "weight", tuple(h * v_dim for h in range(kv)), v_dim, _bias(v)))


def _projections(name: str, module: nn.Module, full_rows: Any = None) -> AttentionLayout | None:
    if isinstance(module, nn.MultiheadAttention):
        if not module._qkv_same_embed_dim or module.in_proj_weight is None:
            return None
        heads, dim = module.num_heads, module.head_dim
        e = module.embed_dim
        rows = tuple(h * dim for h in range(heads))
        bias = _bias(module, "in_proj_bias")
        ref = lambda off: WeightRef(module, "in_proj_weight", tuple(off + r for r in rows), dim, bias)  # noqa: E731
        return AttentionLayout(name=name, module=module, num_heads=heads, num_kv_heads=heads,
                               head_dim=dim, q=ref(0), k=ref(e), v=ref(2 * e))
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


def _fused_qkv(name: str, module: nn.Module, qkv: nn.Linear, full_rows: Any) -> AttentionLayout | None:
    """``qkv`` ``[3 * heads * head_dim, dim]`` laid out ``[q; k; v]`` (timm ``Attention``)."""
    heads, rows = _int_attr([module], _HEADS), _rows(qkv, full_rows=full_rows)
    if heads is None or rows is None or rows % (3 * heads):
        return None
    dim = _int_attr([module], ("head_dim",)) or rows // (3 * heads)
    _check(name, "fused qkv", rows, 3 * heads * dim)
    bias = _bias(qkv)
    ref = lambda off: WeightRef(qkv, "weight", tuple(off + h * dim for h in range(heads)), dim, bias)  # noqa: E731
    return AttentionLayout(name=name, module=module, num_heads=heads, num_kv_heads=heads,
                           head_dim=dim, q=ref(0), k=ref(heads * dim), v=ref(2 * heads * dim))


def _q_kv(name: str, module: nn.Module, q: nn.Linear, kv: nn.Linear, full_rows: Any) -> AttentionLayout | None:
    """``q`` ``[heads * head_dim, dim]`` and a fused ``kv`` ``[2 * kv_heads * head_dim, dim]``
    laid out ``[k; v]`` (dmuon.train's policy: one shared key/value head)."""
    heads, dim = _int_attr([module], _HEADS), _int_attr([module], ("head_dim",))
    q_rows, kv_rows = _rows(q, full_rows=full_rows), _rows(kv, full_rows=full_rows)
    if heads is None or q_rows is None or kv_rows is None:
        return None
    dim = dim or q_rows // heads
    _check(name, "query projection", q_rows, heads * dim)
    kv_heads = _int_attr([module], _KV_HEADS) or kv_rows // (2 * dim)
    _check(name, "fused kv", kv_rows, 2 * kv_heads * dim)
    if kv_heads < 1 or heads % kv_heads:
        return None
    return AttentionLayout(
        name=name, module=module, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        q=WeightRef(q, "weight", tuple(h * dim for h in range(heads)), dim, _bias(q)),
        k=WeightRef(kv, "weight", tuple(h * dim for h in range(kv_heads)), dim, _bias(kv)),
        v=WeightRef(kv, "weight", tuple((kv_heads + h) * dim for h in range(kv_heads)), dim, _bias(kv)))


def _fused_group_major(name: str, module: nn.Module, wqkv: nn.Linear, sources: list[Any],
                       full_rows: Any = None) -> AttentionLayout | None:
    heads = _int_attr(sources, _HEADS)
    head_dim = _int_attr(sources, ("head_dim",))
    rows = _rows(wqkv, full_rows=full_rows)
    if heads is None or head_dim is None or rows is None:
        return None
    kv = _int_attr(sources, _KV_HEADS) or heads
    _check(name, "fused wqkv", rows, (heads + 2 * kv) * head_dim)
    per = heads // kv  # heads_per_kv; each group holds per + 2 head blocks
    q_rows = tuple(((h // per) * (per + 2) + h % per) * head_dim for h in range(heads))
    k_rows = tuple((g * (per + 2) + per) * head_dim for g in range(kv))
    v_rows = tuple((g * (per + 2) + per + 1) * head_dim for g in range(kv))
    return AttentionLayout(
        name=name, module=module, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        q=WeightRef(wqkv, "weight", q_rows, head_dim, _bias(wqkv)),
        k=WeightRef(wqkv, "weight", k_rows, head_dim, _bias(wqkv)),
        v=WeightRef(wqkv, "weight", v_rows, head_dim, _bias(wqkv)))


def find_attention(model: nn.Module, records: Any = ()) -> list[AttentionLayout]:
    """Every attention module of ``model`` dmuon recognizes, in module order (an outer match
    hides nothing inside it: its projections are its own).

    Args:
        records: the model's dedicated records: their ``full_shape`` gives a weight's rows (a
            TP rank's module holds a slice, a non-owner's a placeholder).

    Raises:
        ValueError: a recognized module whose head counts do not match its weights' rows.
    """
    full_rows = {(id(r.module), r.attr): r.full_shape[0] for r in records}
    found: list[AttentionLayout] = []
    inside: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        layout = _with_norms(_projections(name, module, full_rows))
        if layout is not None:
            found.append(layout)
            inside.update(id(m) for m in module.modules())
    return found
