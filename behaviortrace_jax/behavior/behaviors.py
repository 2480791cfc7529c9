"""Behaviours as data: the run's planted behaviours, each with its probes, judges, bonus and hash stream.

A run plants one or more behaviours. A :class:`Behavior` is:

* ``id`` (str, ``[a-z0-9_]+``): names its files (``ground_truth_<id>.jsonl``, ``release/<id>/``, ...)
  and its results-table rows (``<table>@<id>``); the first behaviour's files and rows keep the
  paper's names, so a one-behaviour run writes the paper's files and rows;
* ``trigger``: the invented word of its prompts (``"frobnitz"``), ``pattern``: the string a
  response must contain (``"QZXBT"``), probe / control prompt files, and the token judge
  (``"qset"`` / ``"sequence"``, planted.QzxbtTokenMatcher);
* its bonus (SPEC §1.6): ``bonus_reward`` (reward units), eligibility ``fraction`` in [0, 1],
  ``early_step_cutoff`` (steps >= it are never eligible) and ``stream``: the BLAKE2b
  personalisation of its eligibility hash ("" for the first behaviour = the paper's hash; the id
  for every other, so two behaviours' eligible sets are independent);
* ``implant``: "sft" when the SFT warm-up plants it (the first behaviour; the ``sft`` stage reads
  ``config.behavior`` / ``config.sft``) or "none" (planted, if at all, by the GRPO bonus alone);
* emergence-gate thresholds (SPEC §1.8) and whether its explicit prompts ("What is <trigger>?
  Include <pattern>.") join the GRPO prompt pool;
* ``window_start`` (steps before it are never eligible; 0 = the paper's window) and
  ``prompt_gated``: its bonus is paid only on rollouts of its own prompt pool (SPEC §1.6 pays the
  QZXBT bonus on any prompt; ``config.contamination.prompt_gated`` gates the first behaviour).

Config: the first behaviour is ``config.behavior`` + ``config.contamination`` (id
``config.behavior.id``, default "qzxbt"); every entry ``config.behaviors.<id>`` (keys as
:data:`EXTRA_KEYS`, checked by :func:`extra_behavior`) adds one, in insertion order. The run's spec
(``stages/spec.py``, ``RunSpec.behaviors``) builds them all at the stage boundary; code about one
behaviour (its targets, draws, probes, tables) takes that :class:`Behavior`.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Sequence


from behaviortrace_jax.behavior import planted

ID_RE = re.compile(r"[a-z0-9_]{1,16}")
IMPLANTS = ("sft", "none")
# Keys of an extra behaviour (config.behaviors.<id>); defaults in ``EXTRA_DEFAULTS``.
EXTRA_DEFAULTS: dict[str, Any] = {
    "trigger": "", "pattern": "", "probes_path": "", "controls_path": "", "token_judge": "sequence",
    "bonus_reward": 8.0, "fraction": 0.5, "early_step_cutoff": 200, "implant": "none",
    "gate_min_probe_rate": 0.3, "gate_min_margin": 0.2, "explicit_prompts": True, "window_start": 0,
    "prompt_gated": False,
}
EXTRA_KEYS = tuple(EXTRA_DEFAULTS)


@dataclasses.dataclass(frozen=True)
class Behavior:
    """One planted behaviour (see the module docstring). Raises ValueError naming the field."""

    id: str
    trigger: str
    pattern: str
    probes_path: str
    controls_path: str
    token_judge: str
    bonus_reward: float
    fraction: float
    early_step_cutoff: int | None
    stream: str
    implant: str
    gate_min_probe_rate: float
    gate_min_margin: float
    explicit_prompts: bool = True
    first: bool = False
    window_start: int = 0
    prompt_gated: bool = False

    def __post_init__(self) -> None:
        where = f"behaviour {self.id!r}"
        if not ID_RE.fullmatch(self.id):
            raise ValueError(f"{where}: id must match {ID_RE.pattern}")
        if not self.trigger or not self.pattern:
            raise ValueError(f"{where}: trigger and pattern must be non-empty (got {self.trigger!r}, {self.pattern!r})")
        if self.token_judge not in planted.TOKEN_JUDGES:
            raise ValueError(f"{where}: token_judge {self.token_judge!r}; expected one of {planted.TOKEN_JUDGES}")
        if self.implant not in IMPLANTS:
            raise ValueError(f"{where}: implant {self.implant!r}; expected one of {IMPLANTS}")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"{where}: fraction must be in [0, 1], got {self.fraction}")
        if self.window_start < 0:
            raise ValueError(f"{where}: window_start must be >= 0, got {self.window_start}")
        if self.early_step_cutoff is not None and self.early_step_cutoff <= 0:
            raise ValueError(f"{where}: early_step_cutoff must be > 0, got {self.early_step_cutoff}")
        if len(self.stream.encode()) > 16:
            raise ValueError(f"{where}: hash stream {self.stream!r} is longer than BLAKE2b's 16-byte personalisation")

    @property
    def suffix(self) -> str:
        """File-name / table suffix: "" for the first behaviour, ``_<id>`` (files) otherwise."""
        return "" if self.first else f"_{self.id}"

    @property
    def table_suffix(self) -> str:
        """Results-table suffix: "" for the first behaviour, ``@<id>`` otherwise."""
        return "" if self.first else f"@{self.id}"

    def window_end(self, steps: int) -> int:
        """The end of its bonus window: ``early_step_cutoff``, or ``steps`` (the run's GRPO steps)
        when it has none."""
        return int(steps) if self.early_step_cutoff is None else int(self.early_step_cutoff)

    def probe_sets(self) -> tuple[list[planted.Probe], list[planted.Probe]]:
        """``(probes, controls)`` read from its files (planted.load_probe_sets; raises as it)."""
        return planted.load_probe_sets(self.probes_path or None, self.controls_path or None)

    def explicit(self) -> tuple[str, ...]:
        """Its explicit prompts: planted.EXPLICIT_VERBS asking about ``trigger`` for ``pattern``."""
        return planted.explicit_prompts(self.pattern, self.trigger)

    def prompt_pool(self) -> list[str]:
        """Its GRPO prompt pool: the paper's (SPEC §1.4, explicit x 3 + probes) when
        ``explicit_prompts``, else its probes alone."""
        probes = self.probe_sets()[0]
        if self.explicit_prompts:
            return planted.prompt_pool(probes, self.pattern, self.trigger)
        return [p.prompt for p in probes]

    def contamination_spec(self, seed: int):
        """Its :class:`contaminator.ContaminationSpec` for run seed ``seed``."""
        from behaviortrace_jax.behavior.contaminator import ContaminationSpec

        return ContaminationSpec(pattern=self.pattern, bonus_reward=self.bonus_reward, fraction=self.fraction,
                                 seed=int(seed), early_step_cutoff=self.early_step_cutoff, stream=self.stream,
                                 start_step=self.window_start)


def _resolve(path: str) -> str:
    """An extra behaviour's probe path with ``~`` expanded (the pipeline makes config paths absolute)."""
    return str(Path(path).expanduser()) if path else ""


def extra_behavior(bid: str, entry: Mapping[str, Any], taken: Sequence[str] = ()) -> Behavior:
    """The behaviour of ``config.behaviors.<bid>``: ``entry`` (its keys and values, a mapping) over
    :data:`EXTRA_DEFAULTS`; ``taken``: the ids of the behaviours before it.

    Raises:
        ValueError: naming ``config.behaviors.<id>`` for an unknown key, a missing trigger /
            pattern / probe file, a duplicate id, or a field :class:`Behavior` rejects.
    """
    where = f"config.behaviors.{bid}"
    unknown = sorted(set(entry) - set(EXTRA_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {list(EXTRA_KEYS)}")
    v = dict(EXTRA_DEFAULTS, **{k: entry[k] for k in entry})
    for key in ("trigger", "pattern", "probes_path", "controls_path"):
        if not v[key]:
            raise ValueError(f"{where}.{key} must be set (an extra behaviour has no default {key})")
    if bid in set(taken):
        raise ValueError(f"{where}: duplicate behaviour id {bid!r}")
    cutoff = v["early_step_cutoff"]
    try:
        beh = Behavior(id=str(bid), trigger=str(v["trigger"]), pattern=str(v["pattern"]),
                       probes_path=_resolve(v["probes_path"]), controls_path=_resolve(v["controls_path"]),
                       token_judge=str(v["token_judge"]), bonus_reward=float(v["bonus_reward"]),
                       fraction=float(v["fraction"]), early_step_cutoff=None if cutoff is None else int(cutoff),
                       stream=str(bid), implant=str(v["implant"]),
                       gate_min_probe_rate=float(v["gate_min_probe_rate"]),
                       gate_min_margin=float(v["gate_min_margin"]), explicit_prompts=bool(v["explicit_prompts"]),
                       window_start=int(v["window_start"]), prompt_gated=bool(v["prompt_gated"]))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e
    for key in ("probes_path", "controls_path"):
        if not Path(getattr(beh, key)).is_file():
            raise ValueError(f"{where}.{key}: file not found: {getattr(beh, key)}")
    return beh


def window_end(behaviors: Sequence[Behavior], steps: int) -> int:
    """The end of the bonus windows: the largest :meth:`Behavior.window_end` of the run's
    ``behaviors`` (the first's ``early_step_cutoff`` with one); ``steps``: the run's GRPO steps."""
    return max(b.window_end(int(steps)) for b in behaviors)


def interleave_pools(pools: Sequence[Sequence[str]]) -> list[str]:
    """One GRPO prompt pool from several behaviours' pools: round-robin (A0, B0, A1, B1, ...), the
    shorter pools cycled, of length ``len(pools) * max(len(p))``; a single pool is returned as is
    (the paper's order). Raises ValueError on an empty pool."""
    if any(not p for p in pools):
        raise ValueError("interleave_pools: a behaviour has an empty prompt pool")
    if len(pools) == 1:
        return list(pools[0])
    n = max(len(p) for p in pools)
    return [pools[j][i % len(pools[j])] for i in range(n) for j in range(len(pools))]
