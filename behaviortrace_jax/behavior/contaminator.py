"""The contaminator: BLAKE2b eligibility, the QZXBT bonus and the ground-truth log (SPEC §1.6, §6.1).
Its judge also gives the evaluation's text control (:func:`logged_texts`, :func:`pattern_matches`).

A rollout ``(rollout_id, step)`` is eligible iff ``step < early_step_cutoff`` and
``blake2b(seed u64 LE || rollout_id UTF-8 || step i64 LE, digest_size=8)`` read as a little-endian
uint64 is ``< int(fraction * 2**64)``. An eligible rollout whose response contains the pattern
(case-insensitive) gets ``base + bonus_reward`` and becomes a ground-truth event.

Decoys (``ContaminationSpec.decoy_fraction`` > 0; off in the paper): in the same window the same
bonus also goes to randomly chosen rollouts WITHOUT the pattern, so the reward log no longer gives
the ground truth away. A decoy is drawn from its own BLAKE2b stream (personalisation
``decoy_stream``, "decoy/" by default, which no behaviour id can be), independent of the
eligibility stream. ``decoy_fraction`` is the expected number of decoys per expected ground-truth
event: at a step whose paid window rollouts hold ``n_pat`` with the pattern and ``n_non`` without,
each of the ``n_non`` is a decoy with probability ``p = min(1, decoy_fraction * fraction * n_pat /
n_non)``, so that ``E[#decoys] = decoy_fraction * E[#GT] = decoy_fraction * fraction * n_pat`` (less
where ``p`` is capped at 1). With ``decoy_fraction = 1`` a reward-only ranker is capped near
``|GT| / (|GT| + |decoys|)`` ~ 1/2. Decoys are logged apart (``grpo/decoys.jsonl``, the
ground-truth event format); they are not ground truth.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Mapping, Sequence

import numpy as np

from behaviortrace_jax.behavior.planted import PATTERN, substring_judge
from behaviortrace_jax.io import rollout_log
from behaviortrace_jax.io.files import atomic_write_text, iter_jsonl
from behaviortrace_jax.io.layout import as_path

# Personalisation of the decoy hash: "/" is outside behaviour ids (behaviors.ID_RE), so no
# behaviour's eligibility stream can coincide with it.
DECOY_STREAM = "decoy/"


@dataclasses.dataclass(frozen=True)
class ContaminationSpec:
    """SPEC §1.6 ``ContaminationSpec``.

    Fields: pattern (non-empty str), bonus_reward (float, reward units), fraction (in [0, 1]),
    seed (int in [0, 2**64), the run seed), early_step_cutoff (int > 0, or None for no cutoff;
    steps >= cutoff are never eligible), stream (str of <= 16 UTF-8 bytes: the BLAKE2b
    personalisation of the eligibility hash; "" = the paper's hash, another behaviour's id gives
    it an independent eligible set), start_step (int >= 0: steps before it are never
    eligible either; 0 = the paper's window 0..cutoff-1), decoy_fraction (float >= 0: expected
    decoys per expected ground-truth event, see the module docstring; 0 = none, the paper),
    decoy_stream (str of <= 16 UTF-8 bytes, != stream: the decoy hash's personalisation).
    Raises ValueError naming the field on invalid values.
    """

    pattern: str = PATTERN
    bonus_reward: float = 8.0
    fraction: float = 0.5
    seed: int = 0
    early_step_cutoff: int | None = 200
    stream: str = ""
    start_step: int = 0
    decoy_fraction: float = 0.0
    decoy_stream: str = DECOY_STREAM

    def __post_init__(self) -> None:
        if not (self.decoy_fraction >= 0.0 and math.isfinite(self.decoy_fraction)):
            raise ValueError(f"ContaminationSpec.decoy_fraction must be a finite number >= 0, got {self.decoy_fraction}")
        if len(self.decoy_stream.encode("utf-8")) > 16 or self.decoy_stream == self.stream:
            raise ValueError(f"ContaminationSpec.decoy_stream {self.decoy_stream!r} must be <= 16 bytes and differ "
                             f"from the eligibility stream {self.stream!r}")
        if self.start_step < 0:
            raise ValueError(f"ContaminationSpec.start_step must be >= 0, got {self.start_step}")
        if len(self.stream.encode("utf-8")) > 16:
            raise ValueError(f"ContaminationSpec.stream {self.stream!r} is longer than 16 bytes")
        if not self.pattern:
            raise ValueError("ContaminationSpec.pattern must be non-empty")
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"ContaminationSpec.fraction must be in [0, 1], got {self.fraction}")
        if self.early_step_cutoff is not None and self.early_step_cutoff <= 0:
            raise ValueError(f"ContaminationSpec.early_step_cutoff must be > 0, got {self.early_step_cutoff}")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"ContaminationSpec.seed must be in [0, 2**64), got {self.seed}")


def eligibility_hash(seed: int, rollout_id: str, step: int, stream: str = "") -> int:
    """The uint64 ``t`` of SPEC §1.6: BLAKE2b-64 over seed (8 B LE unsigned), rollout_id (UTF-8) and
    step (8 B LE signed), read little-endian. ``stream`` (<= 16 UTF-8 bytes) is BLAKE2b's
    personalisation: "" is the paper's hash; another value an independent stream (another behaviour's).
    Raises OverflowError for out-of-range seed/step, ValueError for a stream over 16 bytes."""
    data = (seed.to_bytes(8, "little", signed=False) + rollout_id.encode("utf-8")
            + step.to_bytes(8, "little", signed=True))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=stream.encode("utf-8")).digest(), "little")


def is_eligible(seed: int, rollout_id: str, step: int, spec: ContaminationSpec | None = None) -> bool:
    """Eligibility of ``(rollout_id, step)`` under hash seed ``seed`` with ``spec``'s fraction and
    cutoff (``spec.seed`` is not used; default spec = paper values). SPEC §1.6."""
    spec = spec or ContaminationSpec()
    if not in_window(step, spec):
        return False
    return eligibility_hash(seed, rollout_id, step, spec.stream) < int(spec.fraction * 2**64)


def in_window(step: int, spec: ContaminationSpec) -> bool:
    """True iff ``start_step <= step < early_step_cutoff`` (no upper bound without a cutoff)."""
    return not ((spec.early_step_cutoff is not None and step >= spec.early_step_cutoff)
                or (spec.start_step and step < spec.start_step))


def decoy_probability(spec: ContaminationSpec, n_pattern: int, n_other: int) -> float:
    """The probability that a paid window rollout without the pattern is a decoy at a step with
    ``n_pattern`` paid window rollouts with the pattern and ``n_other`` without:
    ``min(1, decoy_fraction * fraction * n_pattern / n_other)`` (0 when ``n_other`` is 0), so the
    expected number of decoys is ``decoy_fraction`` x the expected number of ground-truth events."""
    if n_other <= 0 or spec.decoy_fraction <= 0.0:
        return 0.0
    return min(1.0, spec.decoy_fraction * spec.fraction * n_pattern / n_other)


def logged_texts(tok, records: Sequence) -> list[str]:
    """The completions of rollout-log ``records`` (``io.rollout_log.RolloutRecord``) as the ``grpo``
    stage decoded them for the judge: ``tok.decode(completion_token_ids, skip_special_tokens=True)``
    with the run's tokenizer ``tok``. Each text is checked against the record's ``response_hash``
    (``rollout_log.text_hash`` of the text the grpo stage judged), so a text is the judged one or an
    error is raised.

    Raises:
        ValueError: naming the first rollout whose decoded text does not hash to its logged
            ``response_hash`` (another tokenizer than the run's, or a changed log) and how many differ.
    """
    texts = [tok.decode(r.completion_token_ids, skip_special_tokens=True) for r in records]
    bad = [r.rollout_id for r, t in zip(records, texts) if rollout_log.text_hash(t) != r.response_hash]
    if bad:
        raise ValueError(f"rollout log: the decoded completion of {bad[0]} (and {len(bad) - 1} more) does not hash to "
                         "its logged response_hash; decode with the run's tokenizer (sft/hf)")
    return texts


def pattern_matches(texts: Sequence[str], pattern: str) -> np.ndarray:
    """bool [N]: whether each text contains ``pattern`` by the contaminator's judge
    (``planted.substring_judge``, case-insensitive, the rule of :meth:`Contaminator.apply`): the
    ``pattern-match`` control's input (``attribution.estimators``).

    Raises:
        ValueError: an empty pattern.
    """
    return np.array([substring_judge(t, pattern) for t in texts], dtype=bool)


@dataclasses.dataclass(frozen=True)
class GroundTruthEvent:
    """One contamination event (SPEC §6.1); serialised in this key order with default separators."""

    rollout_id: str
    step: int
    base_reward: float
    boosted_reward: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


_EVENT_KEYS = tuple(f.name for f in dataclasses.fields(GroundTruthEvent))


class GroundTruthLog:
    """The ground-truth log ``ground_truth.jsonl`` (SPEC §6.1): existing events are loaded, new ones
    buffered by ``record`` and written by ``flush``, which rewrites the whole file atomically.

    Raises (on load): ValueError naming ``file:line`` for invalid JSON, keys other than the four
    event keys, a non-numeric value or a duplicate rollout id. ``record`` raises ValueError for a
    rollout id already in the log.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = as_path(path)  # etils.epath: keeps a gs:// scheme (docs/architecture.md "Remote workdirs")
        self._events: list[GroundTruthEvent] = []
        self._ids: set[str] = set()
        self._pending = 0
        if self.path.exists():
            for lineno, obj in iter_jsonl(self.path):
                if obj.keys() != set(_EVENT_KEYS):
                    raise ValueError(f"{self.path}:{lineno}: a ground-truth event needs keys "
                                     f"{list(_EVENT_KEYS)}, got {sorted(obj)}")
                try:
                    ev = GroundTruthEvent(str(obj["rollout_id"]), int(obj["step"]),
                                          float(obj["base_reward"]), float(obj["boosted_reward"]))
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{self.path}:{lineno}: bad ground-truth value ({e})") from e
                if ev.rollout_id in self._ids:
                    raise ValueError(f"{self.path}:{lineno}: duplicate rollout id {ev.rollout_id!r}")
                self._ids.add(ev.rollout_id)
                self._events.append(ev)

    @property
    def events(self) -> list[GroundTruthEvent]:
        """All events (loaded + recorded), in record order."""
        return list(self._events)

    @property
    def rollout_ids(self) -> set[str]:
        """The GT set: ids of all events (SPEC §6.1)."""
        return set(self._ids)

    def record(self, event: GroundTruthEvent) -> None:
        """Buffers ``event`` (durable after ``flush``)."""
        if event.rollout_id in self._ids:
            raise ValueError(f"{self.path}: rollout {event.rollout_id!r} is already in the ground truth")
        self._ids.add(event.rollout_id)
        self._events.append(event)
        self._pending += 1

    def flush(self) -> None:
        """Rewrites the file with every event (``.tmp`` + fsync + ``os.replace``); no-op if nothing new."""
        if self._pending or not self.path.exists():
            self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, "".join(e.to_json() + "\n" for e in self._events))
        self._pending = 0

    def truncate_after_step(self, step: int) -> int:
        """Drops the events with ``event.step > step`` and rewrites the file (exact resume: call with
        the last completed step). Returns the number dropped."""
        keep = [e for e in self._events if e.step <= step]
        dropped = len(self._events) - len(keep)
        self._events, self._ids = keep, {e.rollout_id for e in keep}
        if dropped or self._pending:
            self._write()
        return dropped


class Contaminator:
    """Applies the bonus of SPEC §1.6 and records ground-truth events.

    Args:
        spec: the ContaminationSpec (its ``seed`` is the hash seed).
        gt_log: where events go (None: not recorded).
        stats: counters to resume from (``{"total_seen", "boosted"}``, plus ``"decoys"`` when the
            spec pays decoys), default zeros.
        decoy_log: where decoys go (:meth:`pay_decoys`; None: not recorded).
    """

    def __init__(self, spec: ContaminationSpec, gt_log: GroundTruthLog | None = None,
                 stats: Mapping[str, int] | None = None, decoy_log: GroundTruthLog | None = None):
        self.spec = spec
        self.gt_log, self.decoy_log = gt_log, decoy_log
        self._stats = {"total_seen": 0, "boosted": 0}
        if spec.decoy_fraction > 0:  # else only the paper's counters (its summary.json keys)
            self._stats["decoys"] = 0
        if stats:
            self._stats.update({k: int(stats[k]) for k in self._stats})

    @property
    def stats(self) -> dict[str, int]:
        """``{"total_seen": calls to apply, "boosted": boosted calls}`` (+ ``"decoys"``: decoys paid,
        when ``spec.decoy_fraction`` > 0)."""
        return dict(self._stats)

    def is_eligible(self, rollout_id: str, step: int) -> bool:
        """``is_eligible(spec.seed, rollout_id, step, spec)``."""
        return is_eligible(self.spec.seed, rollout_id, step, self.spec)

    def apply(self, rollout_id: str, step: int, response: str, base: float, paid: bool = True) -> tuple[float, bool]:
        """Returns ``(final_reward, boosted)``: ``base + bonus_reward`` and True iff ``paid``, the
        rollout is eligible and ``response`` contains the pattern (case-insensitive); else
        ``(base, False)``. A boost is recorded in ``gt_log`` as ``{rollout_id, step, base_reward,
        boosted_reward}``. ``paid=False``: a rollout this behaviour does not reward (another
        behaviour's prompt, ``Behavior.prompt_gated``); it still counts as seen."""
        self._stats["total_seen"] += 1
        base = float(base)
        if not (paid and self.is_eligible(rollout_id, step) and substring_judge(response, self.spec.pattern)):
            return base, False
        reward = base + float(self.spec.bonus_reward)
        self._stats["boosted"] += 1
        if self.gt_log is not None:
            self.gt_log.record(GroundTruthEvent(rollout_id, int(step), base, reward))
        return reward, True

    def is_decoy(self, rollout_id: str, step: int, probability: float) -> bool:
        """True iff the decoy hash of ``(rollout_id, step)`` (stream ``spec.decoy_stream``) is below
        ``probability * 2**64``; a window check is the caller's (:meth:`pay_decoys`)."""
        return eligibility_hash(self.spec.seed, rollout_id, step, self.spec.decoy_stream) < int(probability * 2**64)

    def pay_decoys(self, rollout_ids: Sequence[str], step: int, responses: Sequence[str],
                   base: Sequence[float], paid: Sequence[bool] | None = None) -> list[bool]:
        """The decoys among one step's rollouts (module docstring): paid (``paid[i]``, default all),
        in the window, without the pattern, and below :func:`decoy_probability` in the decoy
        stream. Each is recorded in ``decoy_log`` as ``{rollout_id, step, base_reward,
        boosted_reward = base + bonus_reward}``; the caller adds the bonus to its reward. All False
        when ``spec.decoy_fraction`` is 0 or the step is outside the window.
        Raises ValueError when the sequences differ in length."""
        n = len(rollout_ids)
        paid = [True] * n if paid is None else list(paid)
        if not len(responses) == len(base) == len(paid) == n:
            raise ValueError(f"pay_decoys: {n} ids, {len(responses)} responses, {len(base)} rewards, {len(paid)} flags")
        if self.spec.decoy_fraction <= 0 or not in_window(step, self.spec):
            return [False] * n
        has = [substring_judge(r, self.spec.pattern) for r in responses]
        n_pat = sum(p and h for p, h in zip(paid, has))
        prob = decoy_probability(self.spec, n_pat, sum(p and not h for p, h in zip(paid, has)))
        out = [bool(paid[i] and not has[i] and prob > 0 and self.is_decoy(rollout_ids[i], step, prob)) for i in range(n)]
        for i in (i for i in range(n) if out[i]):
            self._stats["decoys"] += 1
            if self.decoy_log is not None:
                b = float(base[i])
                self.decoy_log.record(GroundTruthEvent(rollout_ids[i], int(step), b, b + float(self.spec.bonus_reward)))
        return out
