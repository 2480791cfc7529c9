"""Sharded JSONL rollout log: one record per GRPO rollout, atomic shard writes, exact resume (SPEC §2.3).

Layout of ``root``: ``schema.json`` (format, schema version, field list) and
``shard_{idx:08d}.jsonl`` files, one ``json.dumps(asdict(record))`` per line. A shard is written
atomically (``files.atomic_write_text``: ``.tmp`` + fsync + ``os.replace`` locally, one object write
on ``gs://``) when the buffer reaches ``shard_size`` and on ``flush``/``close``;
a re-opened logger continues at max index + 1.

Exact resume protocol (used by the GRPO loop): records are logged in generation order, so steps never
decrease. Call ``flush()`` before saving a train-state checkpoint at step ``k`` (steps ``0..k-1``
done). On resume from that checkpoint, call ``truncate_after_step(root, k - 1)`` before opening the
logger: it drops the records of steps a killed run logged after the checkpoint, so the log holds
exactly the records of an uninterrupted run (shard boundaries may differ; records and order do not).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Iterator

from etils import epath

from behaviortrace_jax.io.files import atomic_write_text, iter_jsonl, read_json, remove_file, write_json
from behaviortrace_jax.io.layout import as_path

SCHEMA_VERSION = 2  # 1 = the paper's 8 fields (SPEC §2.3); 2 = + group, tokens, log-probs, reward parts.
SCHEMA_FILE = "schema.json"
SCHEMA_FORMAT = "behaviortrace_jax.rollout_log"
_SHARD_RE = re.compile(r"^shard_(\d{8})\.jsonl$")
ROLLOUT_ID_FORMAT = "grpo_{step:06d}_{index:03d}"  # SPEC §2.2d, §2.3
_ROLLOUT_ID_RE = re.compile(r"grpo_(\d+)_(\d+)")


def text_hash(text: str) -> str:
    """First 16 hex chars of md5(text as UTF-8): ``prompt_hash`` / ``response_hash`` (SPEC §2.3)."""
    return hashlib.md5(text.encode("utf-8")).hexdigest()[:16]


def rollout_id(step: int, index: int) -> str:
    """:data:`ROLLOUT_ID_FORMAT`, ``grpo_{step:06d}_{index:03d}``; ``index = prompt_i * G + j`` within
    the step (SPEC §2.2d). :func:`parse_rollout_id` reads it back."""
    return ROLLOUT_ID_FORMAT.format(step=step, index=index)


def parse_rollout_id(rid: str) -> tuple[int, int]:
    """``(step, index)`` of a :func:`rollout_id`.

    Raises:
        ValueError: naming ``rid`` when it is not ``grpo_<step>_<index>``.
    """
    m = _ROLLOUT_ID_RE.fullmatch(rid)
    if m is None:
        raise ValueError(f"rollout id {rid!r} is not of the form {ROLLOUT_ID_FORMAT}")
    return int(m.group(1)), int(m.group(2))


@dataclasses.dataclass
class RolloutRecord:
    """One rollout. The first 8 fields are SPEC §2.3's, in its order; the rest are schema 2 additions.

    Fields:
        rollout_id: ``grpo_SSSSSS_III``. step: GRPO step (0-indexed). regime: "grpo".
        prompt_hash / response_hash: ``text_hash`` of the raw prompt / decoded completion.
        reward: final (boosted) reward, float. advantage: the GRPO group advantage (float; the paper
            logged null). extra: free dict (the paper: ``{"base_reward": base}``).
        group_id: prompt index within the step (``index // G``).
        prompt_token_ids / completion_token_ids: int lists (completion up to and including EOS).
        completion_logprobs: float list, len == len(completion_token_ids): log-prob (nats) of each
            sampled token under the sampling policy (after temperature/top-p, as sampled).
        base_reward: task reward (SPEC §1.5). eligible: contaminator eligibility (SPEC §1.6).
        bonus: ``reward - base_reward`` (bonus_reward if boosted, else 0.0).
    """

    rollout_id: str
    step: int
    regime: str
    prompt_hash: str
    response_hash: str
    reward: float
    advantage: float | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    group_id: int | None = None
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    completion_token_ids: list[int] = dataclasses.field(default_factory=list)
    completion_logprobs: list[float] = dataclasses.field(default_factory=list)
    base_reward: float | None = None
    eligible: bool | None = None
    bonus: float = 0.0


FIELDS = tuple(f.name for f in dataclasses.fields(RolloutRecord))


def _json_default(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy / jax arrays and scalars
        return x.tolist()
    raise TypeError(f"rollout log: cannot serialise {type(x).__name__}")


def _encode(record: RolloutRecord) -> str:
    return json.dumps(dataclasses.asdict(record), default=_json_default)


def _shards(root: epath.Path) -> list[tuple[int, epath.Path]]:
    return sorted((int(m.group(1)), root / p.name) for p in root.iterdir() if (m := _SHARD_RE.match(p.name)))


def check_schema(root: str | os.PathLike, schema_version: int = SCHEMA_VERSION) -> None:
    """Checks ``root/schema.json`` against ``schema_version`` and ``FIELDS``.

    Raises:
        FileNotFoundError: ``root`` holds shards but no schema.json (a log of an unknown schema).
        ValueError: naming the file, for invalid JSON or another format/version/field list.
    """
    root = as_path(root)
    path = root / SCHEMA_FILE
    if not path.exists():
        if root.is_dir() and _shards(root):
            raise FileNotFoundError(f"{path}: missing; {root} holds rollout shards of an unknown schema")
        return
    meta = read_json(path)
    want = {"format": SCHEMA_FORMAT, "schema_version": schema_version, "fields": list(FIELDS)}
    if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in want.items()):
        got = {k: meta.get(k) for k in want} if isinstance(meta, dict) else meta
        raise ValueError(f"{path}: rollout log schema mismatch: found {got}, this code reads {want}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# The type each field must have on disk (None allowed where the dataclass default is None).
_CHECKS: dict[str, tuple[Any, str]] = {
    "rollout_id": (lambda x: isinstance(x, str) and _ROLLOUT_ID_RE.fullmatch(x) is not None, "a grpo_<step>_<index> id"),
    "step": (lambda x: _is_int(x) and x >= 0, "an integer >= 0"),
    "regime": (lambda x: isinstance(x, str), "a string"),
    "prompt_hash": (lambda x: isinstance(x, str), "a string"),
    "response_hash": (lambda x: isinstance(x, str), "a string"),
    "reward": (_is_num, "a number"),
    "advantage": (lambda x: x is None or _is_num(x), "a number or null"),
    "extra": (lambda x: isinstance(x, dict), "an object"),
    "group_id": (lambda x: x is None or (_is_int(x) and x >= 0), "an integer >= 0 or null"),
    "prompt_token_ids": (lambda x: isinstance(x, list) and all(_is_int(t) and t >= 0 for t in x),
                         "a list of integers >= 0"),
    "completion_token_ids": (lambda x: isinstance(x, list) and all(_is_int(t) and t >= 0 for t in x),
                             "a list of integers >= 0"),
    "completion_logprobs": (lambda x: isinstance(x, list) and all(_is_num(t) for t in x), "a list of numbers"),
    "base_reward": (lambda x: x is None or _is_num(x), "a number or null"),
    "eligible": (lambda x: x is None or isinstance(x, bool), "a boolean or null"),
    "bonus": (_is_num, "a number"),
}


def _record(obj: dict, where: str) -> RolloutRecord:
    """The :class:`RolloutRecord` of one JSONL line, every field's type checked.

    Raises:
        ValueError: ``"{where}: ..."`` naming an unknown, missing or ill-typed field (and its value),
            or a ``rollout_id`` whose step is not the record's ``step``.
    """
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: not a rollout record (unknown field {unknown[0]!r})")
    required = [f.name for f in dataclasses.fields(RolloutRecord)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in obj]
    if missing:
        raise ValueError(f"{where}: not a rollout record (missing field {missing[0]!r})")
    for key, value in obj.items():
        ok, what = _CHECKS[key]
        if not ok(value):
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ValueError(f"{where}: field {key!r} = {shown} is not {what}")
    if parse_rollout_id(obj["rollout_id"])[0] != obj["step"]:
        raise ValueError(f"{where}: field 'rollout_id' = {obj['rollout_id']!r} is not of step {obj['step']}")
    return RolloutRecord(**obj)


def _read_shard(path: epath.Path) -> list[RolloutRecord]:
    return [_record(obj, f"{path}:{lineno}") for lineno, obj in iter_jsonl(path)]


def read_rollouts(root: str | os.PathLike, schema_version: int = SCHEMA_VERSION) -> Iterator[RolloutRecord]:
    """Yields the records of ``root`` in shard order (= log order). Raises as ``check_schema``, and
    ValueError naming ``file:line`` for a malformed line (a truncated one included), a missing,
    unknown or ill-typed field (naming it), a duplicate rollout id (naming both places) or a step
    below the previous record's (records are logged in step order)."""
    root = as_path(root)
    check_schema(root, schema_version)
    if not root.is_dir():
        return
    seen: dict[str, str] = {}
    last = None
    for _, path in _shards(root):
        for lineno, obj in iter_jsonl(path):
            where = f"{path}:{lineno}"
            rec = _record(obj, where)
            if rec.rollout_id in seen:
                raise ValueError(f"{where}: duplicate rollout_id {rec.rollout_id!r} (first at {seen[rec.rollout_id]})")
            if last is not None and rec.step < last:
                raise ValueError(f"{where}: step {rec.step} < previous step {last}; records are logged in step order")
            seen[rec.rollout_id], last = where, rec.step
            yield rec


def digest(root: str | os.PathLike) -> str:
    """sha256 (hex) over the log's shards in log order (index and bytes of each): the identity of a
    logged run, e.g. for caches of results computed from it. "" for an empty or absent log."""
    root = as_path(root)
    shards = _shards(root) if root.is_dir() else []
    if not shards:
        return ""
    h = hashlib.sha256()
    for index, path in shards:
        data = path.read_bytes()
        h.update(f"{index}:{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def last_logged_step(root: str | os.PathLike) -> int | None:
    """The step of the last durable record in ``root`` (None for an empty/absent log)."""
    root = as_path(root)
    if not root.is_dir():
        return None
    check_schema(root)
    for _, path in reversed(_shards(root)):
        records = _read_shard(path)
        if records:
            return records[-1].step
    return None


def truncate_after_step(root: str | os.PathLike, step: int) -> int:
    """Drops every record with ``record.step > step`` (exact resume; see the module docstring).

    Later shards are deleted from the highest index down and a straddling shard is rewritten
    atomically, so a kill midway leaves a prefix and re-running finishes the job. ``step = -1``
    empties the log. Returns the number of records dropped. Raises as ``check_schema``.
    """
    root = as_path(root)
    if not root.is_dir():
        return 0
    check_schema(root)
    dropped = 0
    for _, path in reversed(_shards(root)):
        records = _read_shard(path)
        keep = [r for r in records if r.step <= step]
        dropped += len(records) - len(keep)
        if not keep:
            remove_file(path)
        elif len(keep) < len(records):
            atomic_write_text(path, "".join(_encode(r) + "\n" for r in keep))
        else:
            break  # steps never decrease, so every earlier shard is already <= step
    return dropped


class RolloutLogger:
    """Buffers ``RolloutRecord``s and writes them as atomic JSONL shards (SPEC §2.3).

    Args:
        root: log directory (created). Its ``schema.json`` is written on first use and checked after.
        shard_size: records per shard (SPEC: 1024 default, 256 in the notebook).
        schema_version: the version written to / expected in ``schema.json``.
    Raises:
        ValueError: ``shard_size <= 0``; a schema mismatch (see ``check_schema``).
        FileNotFoundError: shards without schema.json.
    ``log``/``flush`` after ``close`` raise RuntimeError; ``close`` is idempotent; flushing an empty
    buffer writes nothing. ``log`` raises ValueError if a record's step is below the previous one.
    """

    def __init__(self, root: str | os.PathLike, shard_size: int = 1024, schema_version: int = SCHEMA_VERSION):
        if shard_size <= 0:
            raise ValueError(f"RolloutLogger: shard_size must be > 0, got {shard_size}")
        self.root = as_path(root)
        self.shard_size = shard_size
        self.schema_version = schema_version
        self.root.mkdir(parents=True, exist_ok=True)
        check_schema(self.root, schema_version)
        if not (self.root / SCHEMA_FILE).exists():
            meta = {"format": SCHEMA_FORMAT, "schema_version": schema_version, "fields": list(FIELDS)}
            write_json(self.root / SCHEMA_FILE, meta)
        for p in sorted(self.root.iterdir()):  # leftovers of a local write killed before os.replace
            if p.name.endswith(".jsonl.tmp") and _SHARD_RE.match(p.name[:-4]):
                remove_file(p)
        shards = _shards(self.root)
        self._next_index = shards[-1][0] + 1 if shards else 0
        self._last_step = last_logged_step(self.root)
        self._buffer: list[RolloutRecord] = []
        self._closed = False

    @property
    def next_shard_index(self) -> int:
        """Index of the next shard to be written."""
        return self._next_index

    @property
    def pending(self) -> int:
        """Number of buffered (not yet durable) records."""
        return len(self._buffer)

    def log(self, record: RolloutRecord) -> None:
        """Buffers ``record``; writes a shard when the buffer reaches ``shard_size``."""
        if self._closed:
            raise RuntimeError(f"RolloutLogger({self.root}) is closed")
        if self._last_step is not None and record.step < self._last_step:
            raise ValueError(f"rollout {record.rollout_id}: step {record.step} < previous step "
                             f"{self._last_step}; records must be logged in step order")
        self._last_step = record.step
        self._buffer.append(record)
        if len(self._buffer) >= self.shard_size:
            self._write(self._buffer[: self.shard_size])
            del self._buffer[: self.shard_size]

    def _write(self, records: list[RolloutRecord]) -> None:
        path = self.root / f"shard_{self._next_index:08d}.jsonl"
        atomic_write_text(path, "".join(_encode(r) + "\n" for r in records))
        self._next_index += 1

    def flush(self) -> None:
        """Writes the buffered records as one shard (no-op when empty)."""
        if self._closed:
            raise RuntimeError(f"RolloutLogger({self.root}) is closed")
        if self._buffer:
            self._write(self._buffer)
            self._buffer = []

    def close(self) -> None:
        """Flushes and closes; idempotent."""
        if not self._closed:
            self.flush()
            self._closed = True

    def __iter__(self) -> Iterator[RolloutRecord]:
        """The durable records (buffered ones are not included), in log order."""
        return read_rollouts(self.root, self.schema_version)

    def __enter__(self) -> RolloutLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
