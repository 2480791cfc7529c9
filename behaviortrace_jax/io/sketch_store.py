"""Sketch arrays on disk: tensorstore zarr3 with metadata and resumable chunked writes (SPEC §3.2).

A store is a directory::

    <path>/metadata.json   {"format", "shape", "chunk_rows", "dtype", **metadata}  (written last, atomically)
    <path>/data/           zarr3 array, shape [N, ...] or [C, N, D]; chunks of ``chunk_rows`` rows
    <path>/done/           zarr3 uint8 array [N] or [C, N]: 1 once the row's data write committed

The *row axis* is axis 0 for 1-D/2-D arrays (``[N]``, ``[N, D]``, norms ``[N, G]``) and axis 1 for
3-D arrays ``[C, N, D]`` (checkpoint x rollout x D), whose writes name the checkpoint with
``lead=(c,)``. :meth:`SketchStore.write_rows` issues an asynchronous tensorstore write and returns
at once; the row's ``done`` flag is written only after its data write has committed, so a job killed
mid-way resumes by computing :meth:`SketchStore.missing_rows` only. :meth:`SketchStore.flush` waits
for everything. A partial last chunk (N not a multiple of ``chunk_rows``) is handled by zarr.

Multi-process runs (one writer, ``files.is_writer()``): the writer creates a new store between two
barriers (``files.mutation``) and the others then open it; rows are gathered to every process by
the caller and only the writer writes them (:meth:`write_rows` is a no-op elsewhere); the reads
(:meth:`read`, :meth:`missing_rows`, :meth:`done_mask`) flush, then read between two barriers, so
every process sees the same rows. Every process must make the same calls in the same order.
The kvstore follows the path (:func:`kvstore_spec`): ``file`` locally, ``gcs`` for ``gs://``.

Example::

    meta = {"hash_family": "splitmix64-countsketch-v3", "seed": 0, "dim": 65536, "param_fingerprint": layout.fingerprint,
            "model_fingerprint": "...", "dtype": "float32"}
    store = SketchStore.open_or_create(run / "sketches/rollouts", (n, 65536), 16, meta)
    todo = store.missing_rows()              # after a kill: only the unfinished rows
    for start in range(0, n, 16):
        if ((todo >= start) & (todo < start + 16)).any():
            store.write_rows(start, sketcher(params, batch_at(start)).sketches)   # async
    store.flush()
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Sequence

import numpy as np
import tensorstore as ts
from etils import epath

from behaviortrace_jax.io import files
from behaviortrace_jax.io.files import read_json
from behaviortrace_jax.io.layout import as_path

FORMAT = "behaviortrace-sketch-store-v1"
# The ``rollout_sketch`` metadata of the grpo stage's ``rollout_sketches`` store (sketch/stores.py),
# here so that the numpy-only ``attribution`` layer reading that store checks it against one list.
ROLLOUT_DIRECTION = "direction"  # rollout_sketches = sketch of grad(-meanlp_i): advantage-free
ROLLOUT_TERM = "term"  # rollout_sketches = sketch of grad(term_i): the loss has no rollout coefficients
ROLLOUT_SKETCH_KINDS = (ROLLOUT_DIRECTION, ROLLOUT_TERM)
_META = "metadata.json"


def _jsonable(x: Any) -> Any:
    """Metadata value normalised the way it reads back from JSON (tuples -> lists, numpy -> python)."""
    return json.loads(json.dumps(x, default=lambda o: o.item() if hasattr(o, "item") else o.tolist()))


def kvstore_spec(path: str | os.PathLike) -> dict:
    """The tensorstore kvstore for ``path``: ``{"driver": "gcs", "bucket", "path"}`` for
    ``gs://bucket/key...``, else ``{"driver": "file", "path"}`` (directory keys end in ``/``).

    Raises:
        ValueError: a URL of another scheme, or ``gs://`` without a bucket.
    """
    p = os.fspath(path)
    if "://" not in p:
        return {"driver": "file", "path": p.rstrip("/") + "/"}
    scheme, rest = p.split("://", 1)
    bucket, _, key = rest.partition("/")
    if scheme != "gs" or not bucket:
        raise ValueError(f"{p}: sketch stores support local paths and gs://bucket/... only")
    return {"driver": "gcs", "bucket": bucket, "path": key.strip("/") + "/"}


def _zarr_spec(path: Any, shape: Sequence[int], chunks: Sequence[int], dtype: str) -> dict:
    return {"driver": "zarr3", "kvstore": kvstore_spec(path),
            "metadata": {"shape": list(shape), "data_type": dtype, "fill_value": 0,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                         "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}}


def array_specs(path: str | os.PathLike, shape: Sequence[int], chunk_rows: int, dtype: str) -> dict[str, dict]:
    """The tensorstore specs of the store at ``path``: ``{"data": ..., "done": ...}``, zarr3 arrays on
    the kvstore :func:`kvstore_spec` chooses from ``path`` (``file`` locally, ``gcs`` for ``gs://``),
    under the keys ``<path>/data/`` and ``<path>/done/``. Every tensorstore the project opens is
    opened from one of these specs."""
    path, shape = as_path(path), tuple(int(s) for s in shape)
    lead = 2 if len(shape) == 3 else 1
    chunks = SketchStore._chunks(shape, chunk_rows)
    return {"data": _zarr_spec(path / "data", shape, chunks, np.dtype(dtype).name),
            "done": _zarr_spec(path / "done", shape[:lead], chunks[:lead], "uint8")}


class SketchStore:
    """A resumable on-disk array of sketches (or norms); use :meth:`open_or_create`.

    Attributes: ``path``, ``shape``, ``dtype`` (numpy), ``chunk_rows``, ``metadata`` (the full dict
    as stored, including ``format``, ``shape``, ``chunk_rows`` and ``dtype``), ``row_axis``.
    """

    def __init__(self, path: epath.Path, data: ts.TensorStore, done: ts.TensorStore, metadata: dict,
                 max_pending: int):
        self.path, self._data, self._done, self.metadata = path, data, done, metadata
        self.shape = tuple(metadata["shape"])
        self.chunk_rows = int(metadata["chunk_rows"])
        self.dtype = np.dtype(metadata["dtype"])
        self.row_axis = 1 if len(self.shape) == 3 else 0
        self._pending: list[tuple[Any, tuple, slice, np.ndarray]] = []
        self._done_futs: list[Any] = []
        self._max_pending = max_pending

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, shape: Sequence[int], chunk_rows: int,
                       metadata: dict, dtype: str | None = None, max_pending: int = 8) -> "SketchStore":
        """Opens the store at ``path`` or creates it.

        Args:
            path: the store directory.
            shape: ``[N]``, ``[N, D]`` or ``[C, N, D]`` (row axis: see module docstring).
            chunk_rows: rows per zarr chunk (the unit of resume); >= 1.
            metadata: JSON-serialisable dict, e.g. ``{hash_family, seed, dim, param_fingerprint,
                model_fingerprint, dtype, ...}``; compared key by key with an existing store.
            dtype: array dtype; default ``metadata["dtype"]`` or "float32".
            max_pending: writes in flight before :meth:`write_rows` waits for the oldest.
        Raises:
            ValueError: bad shape/chunk_rows; an existing store whose shape, chunk_rows, dtype or any
                metadata key differs (the message names the key and both values).
        """
        path = as_path(path)
        shape = tuple(int(s) for s in shape)
        if not 1 <= len(shape) <= 3 or min(shape) < 1:
            raise ValueError(f"{path}: shape must have 1-3 positive dims, got {shape}")
        if int(chunk_rows) != chunk_rows or chunk_rows < 1:
            raise ValueError(f"{path}: chunk_rows must be a positive integer, got {chunk_rows!r}")
        dtype = np.dtype(dtype or metadata.get("dtype", "float32")).name
        if "dtype" in metadata and np.dtype(metadata["dtype"]).name != dtype:
            raise ValueError(f"{path}: dtype={dtype!r} but metadata['dtype']={metadata['dtype']!r}")
        full = _jsonable({**metadata, "format": FORMAT, "shape": list(shape), "chunk_rows": int(chunk_rows),
                          "dtype": dtype})
        meta_path = path / _META
        specs = array_specs(path, shape, int(chunk_rows), dtype)
        if meta_path.exists():
            stored = read_json(meta_path)
            for key in sorted(set(full) | set(stored)):
                if full.get(key, "<absent>") != stored.get(key, "<absent>"):
                    raise ValueError(f"{meta_path}: metadata key {key!r} is {stored.get(key, '<absent>')!r} "
                                     f"in the store but {full.get(key, '<absent>')!r} was requested")
            return cls(path, *cls._open_arrays(specs, {"open": True}), stored, max_pending)
        # no metadata.json: a fresh (or never finished) store, created by the writer process only
        with files.mutation(f"create {path}") as write:
            if write:
                path.mkdir(parents=True, exist_ok=True)
                arrays = cls._open_arrays(specs, {"create": True, "delete_existing": True})
                files.write_text_now(meta_path, json.dumps(full, indent=1, sort_keys=True) + "\n")
        if not write:
            arrays = cls._open_arrays(specs, {"open": True})
        return cls(path, *arrays, full, max_pending)

    @staticmethod
    def _open_arrays(specs: dict[str, dict], mode: dict) -> tuple[ts.TensorStore, ts.TensorStore]:
        data = ts.open(specs["data"], **mode).result()
        done = ts.open(specs["done"], **mode).result()
        return data, done

    @classmethod
    def open(cls, path: str | os.PathLike, max_pending: int = 8) -> "SketchStore":
        """Opens an existing store for reading with the shape and metadata it was created with.

        Raises:
            FileNotFoundError: naming ``path`` when it holds no completed ``metadata.json``.
        """
        meta_path = as_path(path) / _META
        if not meta_path.is_file():
            raise FileNotFoundError(f"{path}: not a sketch store (no {_META})")
        stored = read_json(meta_path)
        meta = {k: v for k, v in stored.items() if k not in ("format", "shape", "chunk_rows")}
        return cls.open_or_create(path, stored["shape"], stored["chunk_rows"], meta, max_pending=max_pending)

    @staticmethod
    def _chunks(shape: tuple[int, ...], chunk_rows: int) -> list[int]:
        if len(shape) == 3:
            return [1, min(chunk_rows, shape[1]), shape[2]]
        return [min(chunk_rows, shape[0])] + list(shape[1:])

    def _lead(self, lead: Sequence[int]) -> tuple[int, ...]:
        lead = tuple(int(i) for i in lead)
        if len(lead) != self.row_axis:
            raise ValueError(f"{self.path}: a {len(self.shape)}-D store needs lead of length {self.row_axis} "
                             f"(the checkpoint index), got {lead}")
        if lead and not 0 <= lead[0] < self.shape[0]:
            raise ValueError(f"{self.path}: lead index {lead[0]} out of range [0, {self.shape[0]})")
        return lead

    def write_rows(self, start: int, array: Any, lead: Sequence[int] = ()) -> None:
        """Asynchronously writes ``array`` (rows ``start .. start + len(array) - 1`` along the row axis,
        trailing shape as the store's) and marks those rows done once the write has committed.

        ``array`` may be a numpy or JAX array; it is copied to host memory here. Raises ValueError
        naming the store for a shape mismatch or rows outside ``[0, N)``.
        """
        lead = self._lead(lead)
        arr = np.asarray(array, dtype=self.dtype)
        n_rows = self.shape[self.row_axis]
        if arr.shape[1:] != self.shape[self.row_axis + 1:] or arr.ndim == 0:
            raise ValueError(f"{self.path}: rows of shape {arr.shape[1:]} do not fit a store of shape {self.shape}")
        if not 0 <= start or start + arr.shape[0] > n_rows:
            raise ValueError(f"{self.path}: rows [{start}, {start + arr.shape[0]}) outside [0, {n_rows})")
        if not files.is_writer():
            return
        rows = slice(int(start), int(start) + arr.shape[0])
        fut = self._data[lead + (rows,)].write(arr)
        self._pending.append((fut, lead, rows, arr))
        self._drain(block=len(self._pending) > self._max_pending)

    def _drain(self, block: bool) -> None:
        """Issues the done flags of committed writes; with ``block`` waits for the oldest write."""
        keep = []
        for i, (fut, lead, rows, arr) in enumerate(self._pending):
            if (block and i == 0) or fut.commit.done():
                fut.commit.result()  # re-raises a failed write
                flags = np.ones(rows.stop - rows.start, np.uint8)
                self._done_futs.append(self._done[lead + (rows,)].write(flags))
            else:
                keep.append((fut, lead, rows, arr))
        self._pending = keep
        still = []
        for f in self._done_futs:
            if f.done():
                f.result()  # re-raises a failed flag write
            else:
                still.append(f)
        self._done_futs = still

    def flush(self) -> None:
        """Waits for every pending write and its done flag (call before reading or exiting)."""
        while self._pending:
            self._drain(block=True)
        for f in self._done_futs:
            f.result()
        self._done_futs = []

    def done_mask(self) -> np.ndarray:
        """bool array ``[N]`` (or ``[C, N]``): True where the row's write committed (flushes first)."""
        with self._reading("done_mask"):
            return self._done.read().result().astype(bool)

    def missing_rows(self, lead: Sequence[int] = ()) -> np.ndarray:
        """Row indices (int64, ascending) not yet written under ``lead`` (``(c,)`` for 3-D stores);
        flushes pending writes first."""
        lead = self._lead(lead)
        with self._reading("missing_rows"):
            mask = self._done[lead].read().result() if lead else self._done.read().result()
        return np.flatnonzero(mask == 0).astype(np.int64)

    def read(self, rows: Any = None, lead: Sequence[int] = ()) -> np.ndarray:
        """Reads the array: everything (``rows=None``, ``lead=()``), or ``rows`` (slice or int
        array along the row axis) under ``lead`` (a 3-D store with ``lead=()`` reads all checkpoints).
        Pending writes are flushed first."""
        lead = self._lead(lead) if lead else ()
        idx = lead + (slice(None),) * (self.row_axis - len(lead))
        with self._reading("read"):
            if rows is None or isinstance(rows, slice):
                return self._data[idx + (rows if rows is not None else slice(None),)].read().result()
            return self._data.oindex[idx + (np.asarray(rows, np.int64),)].read().result()

    @contextlib.contextmanager
    def _reading(self, what: str) -> Iterator[None]:
        """Flushes, then reads between two barriers (multi-process: every process sees the same rows)."""
        self.flush()
        files.sync(f"{what} {self.path}")
        try:
            yield
        finally:
            files.sync(f"{what} done {self.path}")

    def __enter__(self) -> "SketchStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.flush()
