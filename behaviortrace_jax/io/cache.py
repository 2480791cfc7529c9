"""Keyed result files: the one rule for every stage that reuses a file instead of recomputing it.

A cached result is a JSON object written with a ``"cache"`` record, its *key*: everything that
defines the result (config fields, input digests such as ``rollout_log.digest``, a code version),
as a flat ``{field: JSON value}`` map. A stage asks :func:`load` for the file with the key it would
compute now:

* no file: None (compute it);
* a file whose key differs in some fields (or that has no key at all: written by older code, or
  by hand): None, and one log line naming the file and every differing field (recompute it);
* a file whose key matches: the record, after ``check(record)`` has checked its shapes; a file
  that is not a JSON object, a ``"cache"`` record that is not an object, or a record that fails
  ``check`` raises a ``ValueError`` naming the file and the field (a corrupt file is refused, never
  silently used nor silently overwritten).

:func:`store` writes the record with its key (atomically, ``files.write_json``). :func:`digest` is
the one digest of a JSON-able value (a config section, a spec) used inside keys. Used by the
``metagradient`` stage (``metagradient/<mode>.json``, ``metagradient/scores.json``, read back by
``attribution/scores.py``), the ``counterfactual`` stage's replays (``stale_fields``) and the
pipeline's stage fingerprints (``stages/fingerprint.py``: each stage's outputs keyed by the config
values and inputs that made them; :func:`flatten` and :func:`differences` give its keys and the
fields a refusal names with both values).
Imports no jax (the ``attribution`` layer may use it).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Callable, Mapping

from absl import logging

from behaviortrace_jax.io.files import read_json, write_json

CACHE_FIELD = "cache"  # the key's field in a cached record


def digest(obj: Any) -> str:
    """sha256 (hex) of ``obj``'s canonical JSON (sorted keys; non-JSON values by ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def check_key(key: Mapping[str, Any], where: str = "cache key") -> dict[str, Any]:
    """``key`` as a plain dict after checking that it can be stored and compared: a non-empty map of
    ``str`` fields to finite JSON values (str, int, float, bool, None, lists / maps of those).

    Raises:
        ValueError: naming ``where`` and the field that is not of that form.
    """
    if not isinstance(key, Mapping) or not key:
        raise ValueError(f"{where}: expected a non-empty map of fields, got {key!r}")

    def ok(v: Any) -> bool:
        if v is None or isinstance(v, (str, bool, int)):
            return True
        if isinstance(v, float):
            return math.isfinite(v)
        if isinstance(v, (list, tuple)):
            return all(ok(x) for x in v)
        if isinstance(v, Mapping):
            return all(isinstance(k, str) and ok(x) for k, x in v.items())
        return False

    for k, v in key.items():
        if not isinstance(k, str) or not ok(v):
            raise ValueError(f"{where}: field {k!r} = {v!r} is not a finite JSON value")
    # JSON round trip: tuples become lists, as they read back from the file
    return json.loads(json.dumps(dict(key)))


def stale_fields(cached: Mapping[str, Any] | None, key: Mapping[str, Any]) -> list[str] | None:
    """None when there is no cached record (``cached`` None); else the fields of ``key`` that the
    record's ``"cache"`` map lacks or holds another value of, plus the fields it holds that ``key``
    does not ([] = valid). A record without a ``"cache"`` map is stale in every field of ``key``."""
    if cached is None:
        return None
    have = cached.get(CACHE_FIELD) if isinstance(cached, Mapping) else None
    have = have if isinstance(have, Mapping) else {}
    want = json.loads(json.dumps(dict(key)))
    return [k for k, v in want.items() if have.get(k, _ABSENT) != v] + sorted(k for k in have if k not in want)


_ABSENT = object()
ABSENT = "<absent>"  # how :func:`differences` shows a field one side lacks


def flatten(obj: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested map as a flat ``{"a.b.c": value}`` map (dotted field names, as the config's keys),
    the form of a key whose differing fields are named one by one; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(recorded: Mapping[str, Any], key: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(field, recorded value, value now)`` of every field of two keys that differs, in field
    order; a field that one side lacks shows :data:`ABSENT` there ([] = the keys are equal).
    Values are compared as they read back from JSON (a tuple equals its list)."""
    have, want = (json.loads(json.dumps(dict(x), default=str)) for x in (recorded, key))
    return [(k, have.get(k, ABSENT), want.get(k, ABSENT)) for k in sorted(set(have) | set(want))
            if have.get(k, _ABSENT) != want.get(k, _ABSENT)]


def load(path: str | os.PathLike, key: Mapping[str, Any], *, what: str,
         check: Callable[[dict], None] | None = None) -> dict | None:
    """The record cached at ``path`` when its key equals ``key``, else None (module docstring).

    Args:
        path: the cached JSON file (local or ``gs://``).
        key: the key the caller would write now (:func:`check_key`'s form).
        what: the cache's name in log lines (e.g. "metagradient").
        check: ``check(record)`` raises ``ValueError`` naming a field of a record whose shapes are
            wrong (called only for a record whose key matches).
    Returns:
        the record (a dict, its ``"cache"`` field included), or None: no file, or a stale one (the
        log line names each differing field).
    Raises:
        ValueError: naming ``path``: invalid JSON, not a JSON object, a ``"cache"`` field that is not
            an object, or a record that ``check`` refuses (its message, prefixed with the path).
    """
    key = check_key(key, f"{path}: the key")
    rec = read_json(path, None)
    if rec is None:
        return None
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(rec).__name__}")
    if CACHE_FIELD in rec and not isinstance(rec[CACHE_FIELD], dict):
        raise ValueError(f"{path}: field {CACHE_FIELD!r} is a {type(rec[CACHE_FIELD]).__name__}, expected an "
                         "object of key fields")
    stale = stale_fields(rec, key)
    if stale:
        why = ("it has no key" if CACHE_FIELD not in rec else "it differs in " + ", ".join(stale))
        logging.info("%s: %s is stale (%s); recomputing it", what, path, why)
        return None
    if check is not None:
        try:
            check(rec)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e if isinstance(e, ValueError) else repr(e)}; delete the file to recompute "
                             "it") from e
    return rec


def store(path: str | os.PathLike, record: Mapping[str, Any], key: Mapping[str, Any]) -> dict:
    """Writes ``record`` with ``"cache": key`` to ``path`` atomically (``files.write_json``); returns
    what was written.

    Raises:
        ValueError: ``record`` already has a ``"cache"`` field, or ``key`` is not of
            :func:`check_key`'s form (nothing is written).
    """
    if CACHE_FIELD in record:
        raise ValueError(f"{path}: the record has its own {CACHE_FIELD!r} field")
    out = dict(record, **{CACHE_FIELD: check_key(key, f"{path}: the key")})
    write_json(path, out)
    return out
