"""The config schema: every key a run reads is a key of ``configs/common.py``'s config.

``configs/common.py`` holds every key with its default and a comment; the other configs change a
few values. A user's config file that misspells a key (``c.grpo.stpes = 10``) or sets one that
nothing reads would otherwise pass without a word (``ml_collections`` accepts new keys while a
config is unlocked), so ``main.py`` checks the loaded config against the schema before any stage
runs. ``config.behaviors.<id>`` subtrees are free-form ids whose keys ``behavior/behaviors.py``
checks (``EXTRA_KEYS``).
"""
from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

import ml_collections

FREE_FORM = ("behaviors",)  # subtrees whose children are ids, checked by their own readers


def key_paths(config: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every leaf of ``config`` (a ``ConfigDict`` or dict); a free-form subtree
    yields its own path only."""
    for key in config.keys():
        path = f"{prefix}{key}"
        value = config[key]
        if isinstance(value, (ml_collections.ConfigDict, dict)) and path not in FREE_FORM:
            if len(value) == 0:
                yield path
            yield from key_paths(value, path + ".")
        else:
            yield path


def check_config(config: Any, schema: Any, *, source: str = "the config") -> None:
    """Raises ValueError when ``config`` has a key that ``schema`` (``configs/common.get_config()``)
    lacks, naming each such key and the nearest valid one.

    Args:
        config: the run's config (``ml_collections.ConfigDict``).
        schema: the config holding every valid key (``configs/common.py``).
        source: how to name the config in the message (e.g. its file).
    """
    valid = set(key_paths(schema))
    unknown = [p for p in key_paths(config) if p not in valid]
    if unknown:
        lines = []
        for p in unknown:
            near = difflib.get_close_matches(p, valid, n=1, cutoff=0.5)
            lines.append(f"{p!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise ValueError(f"{source}: unknown config key(s) {', '.join(lines)}; every key a run reads is in "
                         "configs/common.py with its default and a comment")
