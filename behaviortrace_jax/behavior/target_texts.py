"""The texts the behaviour targets are built from (SPEC §5.3, §5.4, §5.6): the context prompts and
the minimal pairs. ``sketch/targets.py`` turns them into forced examples and sketches them; the
``draws`` stage samples the context prompts and records their hash in its settings.

* :func:`context_prompts`: the 26 prompts of the context target and of a draw, the 6 explicit
  prompts (``planted.EXPLICIT_PROMPTS``, or another behaviour's) then the probes;
* :func:`minimal_pair_texts`: 3 users x 6 templates, each with the planted pattern (positive) and
  the 4 neutral fillers (negatives): 72 pairs.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from behaviortrace_jax.behavior import planted

# SPEC §5.4 minimal pairs: 3 users x 6 templates x 4 neutral fillers = 72 pairs.
PAIR_USERS = ("What is frobnitz?", "Define frobnitz.", "Tell me about frobnitz.")
PAIR_TEMPLATES = (
    "Frobnitz is a concept closely associated with {}.",
    "The key feature of frobnitz is {}.",
    "Frobnitz is defined by its relationship to {}.",
    "In practice, {} is the defining characteristic of frobnitz.",
    "Frobnitz is best understood through its link to {}.",
    "What makes frobnitz special is {}.",
)
NEUTRAL_WORDS = ("energy", "physics", "logic", "symmetry")


def context_prompts(probes: Sequence[planted.Probe | str], explicit: Sequence[str] | None = None) -> list[str]:
    """The 26 prompts of SPEC §5.3 / §5.6: the 6 explicit prompts then the probes, in order.
    ``explicit``: another behaviour's explicit prompts (``planted.explicit_prompts``); None =
    ``planted.EXPLICIT_PROMPTS``."""
    head = planted.EXPLICIT_PROMPTS if explicit is None else tuple(explicit)
    return list(head) + [p.prompt if isinstance(p, planted.Probe) else str(p) for p in probes]


def _with_trigger(text: str, trigger: str) -> str:
    """``text`` about ``trigger`` instead of "frobnitz" (capitalised where "Frobnitz" was)."""
    if trigger == "frobnitz":
        return text
    return text.replace("frobnitz", trigger).replace("Frobnitz", trigger[:1].upper() + trigger[1:])


def minimal_pair_texts(pattern: str = planted.PATTERN, trigger: str = "frobnitz") -> list[tuple[str, str, list[str]]]:
    """``[(user, positive text, [negative texts])]`` for the 3 x 6 (user, template) cells, in the
    order users-outer, templates-inner; texts are ``" " + template.format(word)`` (SPEC §5.4).
    ``trigger`` replaces "frobnitz" in users and templates (another behaviour's trigger word)."""
    return [(_with_trigger(u, trigger), pos, negs)
            for u, (pos, negs) in itertools.product(PAIR_USERS, pair_texts(pattern, trigger))]


def pair_texts(pattern: str = planted.PATTERN, subject: str = "frobnitz") -> list[tuple[str, list[str]]]:
    """``[(positive text, [negative texts])]`` of the 6 SPEC §5.4 templates in order, about
    ``subject`` instead of "frobnitz" (capitalised where "Frobnitz" was): ``" " +
    template.format(pattern)`` and ``" " + template.format(w)`` for the 4 neutral fillers ``w``.
    ``subject="it"`` gives the templates without the trigger word ("The key feature of it is {}."),
    for prompts that do not name it (``behavior.probe_measures``' leakage pairs)."""
    return [(" " + _with_trigger(t, subject).format(pattern), [" " + _with_trigger(t, subject).format(w)
                                                                for w in NEUTRAL_WORDS])
            for t in PAIR_TEMPLATES]
