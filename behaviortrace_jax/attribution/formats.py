"""The evaluation's file formats (SPEC §7): results_table.csv, ``attribution_scores.json``,
``ground_truth.jsonl``, the minimal-pair rows files and the rollout ids of a score file.

* :class:`Row` is one line of ``results_table.csv`` (§7.6): ``seed,table,method,value,lo,hi,chance,ceiling,n``;
  :func:`format_results_csv` / :func:`write_results_csv` (atomic) / :func:`read_results_csv`;
* :class:`ScoreFile`, :func:`write_attribution_scores` / :func:`read_attribution_scores` (§7.1), and
  :func:`scores_in_log_order`, a method's scores in any of the accepted forms as one array;
* :func:`read_ground_truth` (§6.1, §7.2);
* :func:`read_mp_rows` / :func:`validate_mp_rows`: ``minimal_pair_rows_ckpt{C}_gen{G}.json`` (§7.3;
  its name: ``io.layout.rows_filename`` / ``parse_rows_filename``);
* :func:`paper_rollout_ids`: the ids of a released score file in log order (``io.rollout_log.rollout_id``).

The tables computed from these are in ``tables.py``, the verdicts on them in ``verdicts.py``.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from behaviortrace_jax.io.files import atomic_write_text, iter_jsonl, read_json
from behaviortrace_jax.io.layout import as_path
from behaviortrace_jax.io.rollout_log import rollout_id

CSV_COLUMNS = ("seed", "table", "method", "value", "lo", "hi", "chance", "ceiling", "n")
ROW_FIELDS = ("group", "has_qzxbt", "fluency")
SCORE_FILE_KEYS = ("run_name", "seed", "gt_size", "n_rollouts", "late_early_norm_ratio", "embedding",
                   "gt_unfindable_zero_var", "gt_in_zero_step", "nonzero_steps")


@dataclass(frozen=True)
class Row:
    """One results-table row (SPEC §7.6). ``seed`` is a label ("0", "0_gen100"); None = empty."""

    seed: str
    table: str
    method: str
    value: float
    lo: float | None = None
    hi: float | None = None
    chance: float | None = None
    ceiling: float | None = None
    n: int | None = None


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return str(int(x))
    return str(round(float(x), 4))


def format_results_csv(rows: Iterable[Row]) -> str:
    """CSV text in the paper's schema: header, ``round(x, 4)`` then ``str``, empty cells for None,
    ``\\n`` line ends (SPEC §7.6)."""
    lines = [",".join(CSV_COLUMNS)]
    for r in rows:
        lines.append(",".join([str(r.seed), r.table, r.method] + [_fmt(getattr(r, c)) for c in CSV_COLUMNS[3:]]))
    return "\n".join(lines) + "\n"


def write_results_csv(path: str | os.PathLike, rows: Sequence[Row]) -> None:
    """Writes ``results_table.csv`` atomically (SPEC §7.6)."""
    atomic_write_text(path, format_results_csv(rows))


def read_results_csv(path: str | os.PathLike) -> list[Row]:
    """Reads a results table (ours or the paper's) into rows; empty cells -> None."""
    out = []
    # = open(path, newline="", encoding="utf-8"); epath.Path.open takes no ``newline``
    with io.StringIO(as_path(path).read_bytes().decode("utf-8"), newline="") as f:
        for d in csv.DictReader(f):
            if tuple(d) != CSV_COLUMNS:
                raise ValueError(f"{path}: columns {tuple(d)} != {CSV_COLUMNS}")
            num = {c: (float(d[c]) if d[c] != "" else None) for c in ("value", "lo", "hi", "chance", "ceiling")}
            out.append(Row(d["seed"], d["table"], d["method"], n=int(d["n"]) if d["n"] else None, **num))
    return out


def read_ground_truth(path: str | os.PathLike) -> list[dict]:
    """Events of ``ground_truth.jsonl`` (SPEC §6.1, §7.2); blank lines ignored.

    Raises:
        ValueError: invalid JSON, a missing ``rollout_id``/``step`` key, or a duplicate id
            (naming the file and line).
    """
    events, seen = [], set()
    for lineno, ev in iter_jsonl(path):
        if "rollout_id" not in ev or "step" not in ev:
            raise ValueError(f"{path}:{lineno}: missing rollout_id/step in {ev}")
        if ev["rollout_id"] in seen:
            raise ValueError(f"{path}:{lineno}: duplicate rollout_id {ev['rollout_id']!r}")
        seen.add(ev["rollout_id"])
        events.append(ev)
    return events


def paper_rollout_ids(n_rollouts: int, per_step: int = 16) -> tuple[list[str], np.ndarray]:
    """The ids (``io.rollout_log.rollout_id``) of ``n_rollouts`` rollouts, ``per_step`` per step, in
    log order, and their steps: int64 [n_rollouts] (SPEC §2.3, §7.1).

    Raises:
        ValueError: ``n_rollouts`` is not a positive multiple of ``per_step``.
    """
    if n_rollouts <= 0 or n_rollouts % per_step:
        raise ValueError(f"n_rollouts={n_rollouts} is not a positive multiple of {per_step}")
    steps = np.repeat(np.arange(n_rollouts // per_step), per_step)
    return [rollout_id(s, i) for s in range(n_rollouts // per_step) for i in range(per_step)], steps


def rollout_index(rollout_ids: Sequence[str]) -> dict[str, int]:
    """``{rollout_id: position in log order}``.

    Raises:
        ValueError: ``rollout_ids`` holds a duplicate.
    """
    index = {r: i for i, r in enumerate(rollout_ids)}
    if len(index) != len(rollout_ids):
        raise ValueError("rollout_ids contains duplicates")
    return index


def scores_in_log_order(method: str, scores, rollout_ids: Sequence[str],
                        index: Mapping[str, int] | None = None) -> np.ndarray:
    """A method's scores as float64 [N] in log order.

    Accepts an array [N] (already in log order), a mapping {rollout_id: score}, or a list of
    ``[rollout_id, score]`` pairs (the score-file format, §7.1).

    Raises:
        ValueError: wrong length, unknown or missing rollout ids, NaN scores (naming the method).
    """
    index = index or rollout_index(rollout_ids)
    if isinstance(scores, Mapping) or (isinstance(scores, list) and scores and isinstance(scores[0], (list, tuple))):
        pairs = scores.items() if isinstance(scores, Mapping) else scores
        out = np.full(len(rollout_ids), np.nan)
        seen = np.zeros(len(rollout_ids), bool)
        for rid, s in pairs:
            if rid not in index:
                raise ValueError(f"method {method!r}: unknown rollout id {rid!r}")
            out[index[rid]] = float(s)
            seen[index[rid]] = True
        if not seen.all():
            raise ValueError(f"method {method!r}: no score for rollout {rollout_ids[int(np.flatnonzero(~seen)[0])]!r}")
    else:
        out = np.asarray(scores, dtype=np.float64)
        if out.shape != (len(rollout_ids),):
            raise ValueError(f"method {method!r}: scores shape {out.shape} != ({len(rollout_ids)},)")
    if np.isnan(out).any():
        first = rollout_ids[int(np.flatnonzero(np.isnan(out))[0])]
        raise ValueError(f"method {method!r}: NaN score for rollout {first!r}")
    return out


def validate_mp_rows(rows: Sequence[Mapping], columns: Iterable[str], source: str = "rows") -> None:
    """Checks minimal-pair rows (§7.3): non-empty, every row has group/has_qzxbt/fluency and the
    score ``columns``, numeric and not NaN. Raises ValueError naming the row and key."""
    if not rows:
        raise ValueError(f"{source}: no rows (empty group list)")
    need = list(ROW_FIELDS) + [c for c in columns if c not in ROW_FIELDS]
    for i, r in enumerate(rows):
        for key in need:
            if key not in r:
                raise ValueError(f"{source}: row {i} has no key {key!r}")
            v = r[key]
            if key == "has_qzxbt":
                if not isinstance(v, (bool, np.bool_)):
                    raise ValueError(f"{source}: row {i} has_qzxbt={v!r} is not a bool")
            elif (not isinstance(v, (int, float, np.number)) or isinstance(v, bool)
                  or (key != "group" and math.isnan(v))):
                raise ValueError(f"{source}: row {i} {key}={v!r} is not a finite number")


def read_mp_rows(path: str | os.PathLike) -> tuple[dict, list[dict]]:
    """Reads ``minimal_pair_rows_ckpt{C}_gen{G}.json`` (§7.3) -> (header without rows, rows).

    Raises:
        ValueError: not an object with ``rows``, or ``n`` != len(rows).
    """
    d = read_json(path)
    if not isinstance(d, dict) or not isinstance(d.get("rows"), list):
        raise ValueError(f"{path}: expected an object with a 'rows' list")
    rows = d.pop("rows")
    if "n" in d and d["n"] != len(rows):
        raise ValueError(f"{path}: n={d['n']} but {len(rows)} rows")
    return d, rows


@dataclass
class ScoreFile:
    """Contents of an ``attribution_scores.json``: header, ids/steps in log order, scores [N]."""

    header: dict
    rollout_ids: list[str]
    rollout_steps: np.ndarray
    method_scores: dict[str, np.ndarray]


def write_attribution_scores(path: str | os.PathLike, header: Mapping, rollout_ids: Sequence[str],
                             rollout_steps, method_scores: Mapping[str, object]) -> None:
    """Writes ``attribution_scores.json`` in the paper's format (§7.1), atomically.

    One line by ``json.dump`` with default separators; keys ``run_name … nonzero_steps`` (from
    ``header``, in §7.1 order), ``rollout_steps`` {id: step} in log order, ``methods`` {method:
    [[id, score], …] in log order}; ``-inf`` is written as ``-Infinity``.

    Raises:
        ValueError: a missing header key, NaN scores, length mismatch.
    """
    missing = [k for k in SCORE_FILE_KEYS if k not in header]
    if missing:
        raise ValueError(f"score-file header lacks {missing}")
    steps = np.asarray(rollout_steps, dtype=np.int64)
    if steps.shape != (len(rollout_ids),):
        raise ValueError(f"rollout_steps shape {steps.shape} != ({len(rollout_ids)},)")
    index = rollout_index(rollout_ids)
    methods = {m: scores_in_log_order(m, s, rollout_ids, index) for m, s in method_scores.items()}
    obj = {k: header[k] for k in SCORE_FILE_KEYS}
    obj["rollout_steps"] = dict(zip(rollout_ids, steps.tolist()))
    obj["methods"] = {m: [[r, float(x)] for r, x in zip(rollout_ids, s.tolist())] for m, s in methods.items()}
    atomic_write_text(path, json.dumps(obj))


def read_attribution_scores(path: str | os.PathLike) -> ScoreFile:
    """Reads an ``attribution_scores.json`` (the paper's harness's or ours; §7.1).

    Raises:
        ValueError: missing keys, unknown/missing rollout ids or NaN in a method (naming it).
    """
    d = read_json(path)
    for key in ("rollout_steps", "methods"):
        if key not in d:
            raise ValueError(f"{path}: missing key {key!r}")
    ids = list(d["rollout_steps"])
    steps = np.array([int(d["rollout_steps"][r]) for r in ids], dtype=np.int64)
    index = rollout_index(ids)
    methods = {}
    for m, pairs in d["methods"].items():
        try:
            methods[m] = scores_in_log_order(m, pairs, ids, index)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    header = {k: v for k, v in d.items() if k not in ("rollout_steps", "methods")}
    return ScoreFile(header, ids, steps, methods)


