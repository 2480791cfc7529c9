"""Parameter layouts of the CountSketch: the sketched parameters in Hugging Face order (SPEC §3.1).

:class:`ParamLayout` gives each parameter's global offset (the index of its first coordinate in the
concatenated, row-major-flattened gradient) and the layout's fingerprint, which every sketch store
records; :class:`StackedLayout` is a layout whose middle is L repeated decoder layers, so their
leaves can be sketched in one ``lax.scan`` (``countsketch.sketch_batch_stacked``).

Example::

    layout = ParamLayout.from_entries([("w", (3, 4)), ("b", (4,))])
    layout.offsets     # (0, 12)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Iterable, Sequence

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Names and shapes of the sketched parameters in HF ``model.parameters()`` order (SPEC §3.1).

    ``offsets[k]`` = summed numel of parameters ``0..k-1`` (the global index of the first
    coordinate of parameter k); ``fingerprint`` = sha256 hex of the JSON ``[[name, shape], ...]``,
    stored with every sketch so sketches of different layouts are never mixed.

    Raises ValueError on duplicate names, mismatched lengths or a shape with a negative/non-int dim.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        names, shapes = tuple(self.names), tuple(tuple(int(d) for d in s) for s in self.shapes)
        if len(names) != len(shapes):
            raise ValueError(f"ParamLayout: {len(names)} names but {len(shapes)} shapes")
        seen = set()
        for n, s in zip(names, shapes):
            if n in seen:
                raise ValueError(f"ParamLayout: duplicate parameter name {n!r}")
            seen.add(n)
            if any(d < 0 for d in s):
                raise ValueError(f"ParamLayout: parameter {n!r} has a negative dim in {s}")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "shapes", shapes)

    @classmethod
    def from_entries(cls, entries: Iterable[tuple[str, Sequence[int]]]) -> "ParamLayout":
        """From ``[(name, shape), ...]`` in HF order (e.g. ``model.named_parameters()`` shapes)."""
        entries = list(entries)
        return cls(tuple(n for n, _ in entries), tuple(tuple(s) for _, s in entries))

    def __len__(self) -> int:
        return len(self.names)

    @functools.cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    @functools.cached_property
    def offsets(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)[:-1]]))

    @property
    def total(self) -> int:
        """Total number of coordinates (parameters) P."""
        return int(sum(self.sizes))

    @functools.cached_property
    def fingerprint(self) -> str:
        blob = json.dumps([[n, list(s)] for n, s in zip(self.names, self.shapes)], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def check(self, arrays: Sequence[jax.Array], batch_dims: int = 0) -> None:
        """Raises ValueError naming the parameter when ``arrays`` do not match the layout's shapes
        (after ``batch_dims`` leading axes)."""
        if len(arrays) != len(self.names):
            raise ValueError(f"expected {len(self.names)} gradient arrays in layout order, got {len(arrays)}")
        for n, s, a in zip(self.names, self.shapes, arrays):
            if tuple(a.shape[batch_dims:]) != s:
                raise ValueError(f"gradient of {n!r} has shape {tuple(a.shape)}, layout expects "
                                 f"{'[batch] + ' if batch_dims else ''}{s}")



@dataclasses.dataclass(frozen=True)
class StackedLayout:
    """A :class:`ParamLayout` whose middle is L repeated blocks (decoder layers) of the same J leaves.

    Parameter ``k`` of the layout is one of: ``pre`` (before the blocks, e.g. the embedding),
    ``blocks[i][j]`` (leaf j of block i, e.g. ``model.layers.{i}.mlp.up_proj.weight``) or ``post``
    (after them: the final norm, lm_head). The blocks are contiguous in the layout and every block
    has the same leaf names (after the block prefix) and shapes, so block leaf j's gradients can be
    stacked [L, *shape_j] and sketched in one ``lax.scan`` with per-(block, leaf) offsets
    ``layout.offsets[blocks[i][j]]`` (:func:`sketch_batch_stacked`).

    Raises ValueError (from :meth:`from_prefix`) naming the parameter that breaks the pattern.
    """

    layout: ParamLayout
    pre: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]
    post: tuple[int, ...]
    leaf_names: tuple[str, ...]  # the J names inside a block, e.g. "mlp.up_proj.weight"

    @classmethod
    def from_prefix(cls, layout: ParamLayout, prefix: str = "model.layers.") -> "StackedLayout":
        """The blocks are the names ``f"{prefix}{i}.{leaf}"``, i = 0..L-1 in order."""
        blocks: list[list[int]] = []
        leaves: list[list[str]] = []
        pre, post = [], []
        for k, name in enumerate(layout.names):
            if name.startswith(prefix):
                idx, _, leaf = name[len(prefix):].partition(".")
                if not idx.isdigit() or not leaf:
                    raise ValueError(f"StackedLayout: cannot parse block index of {name!r}")
                i = int(idx)
                if post:
                    raise ValueError(f"StackedLayout: block parameter {name!r} after non-block parameters")
                if i == len(blocks):
                    blocks.append([])
                    leaves.append([])
                elif i != len(blocks) - 1:
                    raise ValueError(f"StackedLayout: {name!r} is out of block order")
                blocks[i].append(k)
                leaves[i].append(leaf)
            elif blocks:
                post.append(k)
            else:
                pre.append(k)
        if not blocks:
            raise ValueError(f"StackedLayout: no parameter name starts with {prefix!r}")
        for i in range(1, len(blocks)):
            same = leaves[i] == leaves[0] and all(
                layout.shapes[a] == layout.shapes[b] for a, b in zip(blocks[i], blocks[0]))
            if not same:
                raise ValueError(f"StackedLayout: block {prefix}{i} differs from block 0 in names or shapes")
        return cls(layout, tuple(pre), tuple(tuple(b) for b in blocks), tuple(post), tuple(leaves[0]))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @functools.cached_property
    def block_offsets(self) -> np.ndarray:
        """uint64 [L, J]: global index of the first coordinate of leaf j of block i."""
        return np.array([[self.layout.offsets[k] for k in b] for b in self.blocks], dtype=np.uint64)

    def block_shape(self, j: int) -> tuple[int, ...]:
        return self.layout.shapes[self.blocks[0][j]]
