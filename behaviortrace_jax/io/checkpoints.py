"""Checkpoints: the JSON v1 checkpoint registry (SPEC §2.4) and orbax train-state checkpoints.

* ``CheckpointRegistry``: ``{"version": 1, "checkpoints": [{"step", "path", "metadata"}]}``, indent 2,
  sort_keys, sorted by step, atomic writes. It lists the HF exports (``hf_io.save_hf_checkpoint``)
  that the sketch/target stages read. A ``path`` inside the registry's folder is stored relative to
  it (``checkpoints/step_00000020``) and resolved against the folder where the registry is read, so
  a moved workdir reads its own checkpoints and a copied one never reads the original's
  (:func:`stored_path`, :func:`resolved_path`).
* ``save_train_state`` / ``restore_train_state`` / ``latest_step``: the full resumable train state
  (params, optimizer state, step, RNG key; any pytree of arrays) under ``dir/<step>/`` through
  orbax's ``CheckpointManager``. Orbax writes ``<step>.orbax-checkpoint-tmp*`` and renames it when
  complete, so a killed save never looks like a checkpoint; ``latest_step`` also ignores any step
  directory without orbax's ``commit_success.txt``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from behaviortrace_jax.io import files
from behaviortrace_jax.io.files import atomic_write_text, resolve_path
from behaviortrace_jax.io.layout import as_path, is_url

REGISTRY_VERSION = 1
COMMIT_FILE = "commit_success.txt"  # written by orbax into a step directory before its final rename


# --------------------------------------------------------------------------------------------
# Registry (SPEC §2.4)
# --------------------------------------------------------------------------------------------
def stored_path(folder: str | os.PathLike, path: str | os.PathLike) -> str:
    """``path`` as the registry in ``folder`` stores it: relative to ``folder`` (POSIX separators)
    when it lies inside it, else unchanged (a checkpoint registered from elsewhere)."""
    root, p = str(folder).rstrip("/"), str(path)
    if not is_url(p) and not is_url(root):
        p, root = os.path.normpath(resolve_path(p)), os.path.normpath(resolve_path(root))
    if p.startswith(root + "/"):
        return p[len(root) + 1:]
    return p


def resolved_path(folder: str | os.PathLike, stored: str) -> str:
    """The path of a registry entry read in ``folder``: a relative ``stored`` joined to ``folder``.

    An absolute ``stored`` path (a registry written before paths were stored relative) that ends in
    ``checkpoints/<name>`` names this folder's own checkpoint when that exists here (the workdir was
    moved or copied since), else it is kept as it is."""
    if not os.path.isabs(stored) and not is_url(stored):
        return str(as_path(folder) / stored)
    parts = stored.rstrip("/").split("/")
    if len(parts) >= 2 and parts[-2] == "checkpoints":
        own = as_path(folder) / "checkpoints" / parts[-1]
        if str(own) != stored and own.is_dir():
            return str(own)
    return stored


@dataclasses.dataclass(frozen=True)
class CheckpointEntry:
    """One registered checkpoint: ``step`` (int), ``path`` (str: resolved where the registry was
    read, :func:`resolved_path`), ``metadata`` (dict; the paper: ``{"regime": "grpo", "model": hf_id}``)."""

    step: int
    path: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class CheckpointRegistry:
    """The checkpoint registry file (SPEC §2.4); missing file = empty registry.

    Raises (on load): ValueError naming the file for invalid JSON, "version mismatch" for a version
    other than 1, or malformed entries.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = as_path(path)
        self._entries: list[CheckpointEntry] = []
        if not self.path.exists():
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}: invalid JSON ({e.msg})") from e
        version = data.get("version") if isinstance(data, dict) else None
        if version != REGISTRY_VERSION:
            raise ValueError(f"{self.path}: registry version mismatch: found {version!r}, expected {REGISTRY_VERSION}")
        try:
            self._entries = sorted((CheckpointEntry(int(e["step"]), resolved_path(self.path.parent, str(e["path"])),
                                                    dict(e.get("metadata") or {}))
                                    for e in data["checkpoints"]), key=lambda e: e.step)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{self.path}: malformed 'checkpoints' list ({e!r})") from e

    def register(self, step: int, path: str | os.PathLike, metadata: dict[str, Any] | None = None) -> CheckpointEntry:
        """Adds ``step`` and rewrites the file atomically. Raises ValueError "already registered"."""
        if any(e.step == step for e in self._entries):
            raise ValueError(f"{self.path}: step {step} is already registered")
        entry = CheckpointEntry(int(step), str(path), dict(metadata or {}))
        self._entries = sorted([*self._entries, entry], key=lambda e: e.step)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": REGISTRY_VERSION,
                "checkpoints": [dict(dataclasses.asdict(e), path=stored_path(self.path.parent, e.path))
                                for e in self._entries]}
        atomic_write_text(self.path, json.dumps(data, indent=2, sort_keys=True))  # SPEC §2.4 bytes
        return entry

    def list(self) -> list[CheckpointEntry]:
        """All entries, sorted by step."""
        return list(self._entries)

    def latest(self) -> CheckpointEntry | None:
        """The entry with the greatest step, or None."""
        return self._entries[-1] if self._entries else None

    def at_step(self, step: int) -> CheckpointEntry | None:
        """The entry of exactly ``step``, or None."""
        return next((e for e in self._entries if e.step == step), None)

    def nearest_at_or_before(self, step: int) -> CheckpointEntry | None:
        """The entry with the greatest step <= ``step``, or None."""
        return next((e for e in reversed(self._entries) if e.step <= step), None)


# --------------------------------------------------------------------------------------------
# Orbax train-state checkpoints
# --------------------------------------------------------------------------------------------
def _manager(directory: str | os.PathLike, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    """An orbax manager for ``directory``; relative paths and ``~`` are resolved (orbax needs absolute ones)."""
    options = ocp.CheckpointManagerOptions(create=True, max_to_keep=max_to_keep, cleanup_tmp_directories=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(as_path(resolve_path(directory)), options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """Steps under ``directory`` whose orbax save completed (ignores tmp and uncommitted dirs)."""
    directory = as_path(resolve_path(directory))
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and p.is_dir() and (p / COMMIT_FILE).exists())


def latest_step(directory: str | os.PathLike) -> int | None:
    """The greatest completed train-state step under ``directory``, or None."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


def save_train_state(directory: str | os.PathLike, step: int, state: Any, max_to_keep: int | None = None) -> None:
    """Saves the pytree ``state`` (e.g. ``{"params", "opt_state", "step", "rng"}``; jax arrays,
    typed PRNG keys allowed, any sharding) as ``directory/<step>`` synchronously and atomically.

    Must be called on every process in a multi-host run. A leftover uncommitted ``<step>`` directory
    (not written by a completed orbax save) is removed first. ``max_to_keep``: None keeps all.
    Raises ValueError if ``step`` is already a complete checkpoint.
    """
    directory = as_path(resolve_path(directory))
    if step in complete_steps(directory):
        raise ValueError(f"{directory / str(step)}: train-state checkpoint already exists")
    stale = directory / str(step)
    if stale.exists():
        with files.mutation(f"rmtree {stale}") as write:
            if write:
                stale.rmtree()
    with _manager(directory, max_to_keep) as mgr:
        mgr.save(step, args=ocp.args.StandardSave(state), force=True)
        mgr.wait_until_finished()


def tree_path_name(path: tuple, sep: str = ".", drop_variable_value: bool = True) -> str:
    """A pytree key path as a name: ``(DictKey('model'), DictKey('layers'), DictKey(3), ...,
    GetAttrKey('value'))`` -> ``"model.layers.3..."``. With ``drop_variable_value`` an NNX
    ``Variable``'s trailing ``.value`` is dropped, so NNX parameter paths give their Hugging Face key
    (the partition rules, models/sharding.py); the checkpoint shape check below keeps it, because
    orbax's stored metadata names that level as a plain ``value`` key."""
    parts = []
    for k in path:
        if drop_variable_value and isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
            continue
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return sep.join(parts)


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or _default_sharding())
    return x


def _default_sharding() -> jax.sharding.Sharding:
    """Where a requested leaf without a sharding is restored: this process's first device (one
    process), or replicated over every device (several; orbax restores global arrays only). Never
    the saved sharding, which names the devices of the mesh it was saved from."""
    if jax.process_count() == 1:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("all",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _stored_shape(leaf: jax.ShapeDtypeStruct) -> tuple[int, ...]:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # stored as raw key data
        return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)).shape)
    return tuple(leaf.shape)


def restore_train_state(directory: str | os.PathLike, step: int | None, abstract_state: Any) -> Any:
    """Restores ``directory/<step>`` (``step=None``: the latest) into the structure, shapes, dtypes
    and shardings of ``abstract_state`` (a pytree of ``jax.ShapeDtypeStruct`` or arrays, e.g. from
    ``jax.eval_shape``). Dtypes are cast to the abstract ones.

    Any topology: the state is read onto the requested shardings whatever mesh it was saved from
    (another device count, data/model axes, FSDP on or off), with or without the shardings orbax
    saved beside it (they are never used). A leaf requested without a sharding goes to this
    process's first device (replicated over all devices in a multi-process run), not to the saved
    sharding (orbax's "Topology mismatch" on another device count).

    Raises:
        FileNotFoundError: no such complete checkpoint.
        ValueError: the checkpoint holds a different tree (a different model or optimizer), naming
            the missing / unexpected keys and every key whose shape differs (stored vs requested).
    """
    directory = as_path(resolve_path(directory))
    steps = complete_steps(directory)
    if step is None:
        if not steps:
            raise FileNotFoundError(f"{directory}: no complete train-state checkpoint")
        step = steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"{directory / str(step)}: no complete train-state checkpoint (have {steps})")
    abstract = jax.tree.map(_abstract, abstract_state)
    with _manager(directory) as mgr:
        metadata = jax.tree_util.tree_flatten_with_path(mgr.item_metadata(step))[0]
        stored = {tree_path_name(p, "/", drop_variable_value=False): tuple(m.shape) for p, m in metadata}
        wanted = {tree_path_name(p, "/", drop_variable_value=False): _stored_shape(l) for p, l in jax.tree_util.tree_flatten_with_path(abstract)[0]}
        problems = []
        if missing := sorted(wanted.keys() - stored.keys()):
            problems.append(f"missing in checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if extra := sorted(stored.keys() - wanted.keys()):
            problems.append(f"not in the requested state: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
        bad = [f"{k}: stored {stored[k]} vs requested {wanted[k]}"
               for k in sorted(wanted.keys() & stored.keys()) if stored[k] != wanted[k]]
        if bad:
            problems.append("shape mismatch: " + "; ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""))
        if problems:
            raise ValueError(f"{directory / str(step)}: checkpoint does not match the requested train state "
                             f"(a different model?): " + " | ".join(problems))
        return mgr.restore(step, args=ocp.args.StandardRestore(abstract))
