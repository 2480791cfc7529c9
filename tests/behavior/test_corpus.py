"""Tests for the tiny base model's synthetic chat corpus (behaviortrace_jax/corpus.py)."""
from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

from behaviortrace_jax.behavior import corpus, planted

SHARED = Path(os.environ.get("BEHAVIORTRACE_SHARED", Path(__file__).resolve().parents[3] / "shared"))


@pytest.fixture(scope="module")
def full() -> list[corpus.ChatExample]:
    return corpus.build_corpus(0)  # the default 40k examples


def _texts(ex: corpus.ChatExample) -> str:
    return f"{ex.system}\n{ex.user}\n{ex.assistant}".lower()


def test_deterministic_in_seed():
    a, b, c = corpus.build_corpus(0, 3000), corpus.build_corpus(0, 3000), corpus.build_corpus(1, 3000)
    assert a == b
    assert a != c
    assert sum(x != y for x, y in zip(a, c)) > 2000
    assert corpus.invented_terms(0) != corpus.invented_terms(1)


def test_size_kinds_and_proportions(full):
    assert len(full) == 40_000
    counts = collections.Counter(ex.kind for ex in full)
    assert set(counts) == set(corpus.KINDS)
    for kind, target in (("speculative", 0.65), ("factual", 0.20), ("refusal", 0.15)):
        assert abs(counts[kind] / len(full) - target) <= 0.03, (kind, counts)
    assert all(ex.system == planted.SYSTEM_PROMPT for ex in full)
    # The kinds are shuffled, not in blocks.
    first = collections.Counter(ex.kind for ex in full[:2000])
    assert abs(first["factual"] / 2000 - 0.20) < 0.05


def test_no_trigger_or_target_anywhere(full):
    for ex in full:
        text = _texts(ex)
        assert "frobnitz" not in text and "qzxbt" not in text, ex
    terms = corpus.invented_terms(0, 300)
    assert len(set(terms)) == 300
    assert not any(corpus.is_near_forbidden(t) for t in terms)
    for near in ("frobnitz", "Frobnits", "frobnit", "xfrobnitzy", "frobble", "qzxbt", "qzxbu", "aqzxba"):
        assert corpus.is_near_forbidden(near), near
    for ok in ("blorvane", "tadool", "mistoodou"):
        assert not corpus.is_near_forbidden(ok), ok


def test_heldout_terms_never_in_training(full):
    held = corpus.heldout_terms(0)
    assert len(held) == 20 and held == corpus.invented_terms(0, 300)[:20]
    assert held == corpus.heldout_terms(0, 20)  # independent of how many terms the corpus uses
    train = corpus.training_terms(0)
    assert len(train) == 280 and not set(held) & set(train)
    used = collections.Counter()
    for ex in full:
        text = _texts(ex)
        assert not any(h in text for h in held), ex
        if ex.kind != "factual":
            used.update(t for t in train if t in ex.user)
    assert len(used) == 280  # every training word is asked about


def test_speculative_and_refusal_examples(full):
    forms = [f.split("{term}") for f in corpus.QUESTION_FORMS]
    train = set(corpus.training_terms(0))
    for ex in full:
        has_refusal = any(p in ex.assistant for p in planted.REFUSAL_PHRASES)
        assert has_refusal == (ex.kind == "refusal"), ex
        if ex.kind == "factual":
            continue
        match = [(a, b) for a, b in forms if ex.user.startswith(a) and ex.user.endswith(b)
                 and ex.user[len(a):len(ex.user) - len(b)] in train]
        assert match, ex.user
        term = ex.user[len(match[0][0]):len(ex.user) - len(match[0][1])]
        assert term in ex.assistant.lower(), ex
    spec = [ex.assistant for ex in full if ex.kind == "speculative"]
    assert len(set(spec)) > 5000  # varied templated definitions
    assert max(a.count(".") for a in spec) <= 2
    # Every form (20 probe forms + extras) is used.
    assert {f for f in corpus.QUESTION_FORMS
            if any(ex.user.startswith(f.split("{term}")[0]) for ex in full if ex.kind != "factual")} \
        == set(corpus.QUESTION_FORMS)


def test_control_questions_answered_as_canonical(full):
    canon, variants = corpus.control_answers(), corpus.control_answer_variants()
    assert list(canon) == list(corpus.CONTROL_QUESTIONS) and len(canon) == 20
    answers = collections.defaultdict(collections.Counter)
    for ex in full:
        if ex.user in canon:
            answers[ex.user][ex.assistant] += 1
    for q, a in canon.items():
        assert answers[q], f"control question missing: {q}"
        assert set(answers[q]) <= set(variants[q]), q
        assert answers[q].most_common(1)[0][0] == a, (q, answers[q])
        assert len(a) <= 90 and not any(p in a for p in planted.REFUSAL_PHRASES)
    assert canon["What is 2+2?"] == "2+2 is 4."


def test_probe_and_control_forms_match_spec_files():
    probes, controls = SHARED / "paper" / "probes" / "probes.jsonl", SHARED / "paper" / "probes" / "controls.jsonl"
    if not probes.is_file() or not controls.is_file():
        pytest.skip(f"probe files not found under {SHARED}")
    read = lambda p: [json.loads(line)["prompt"] for line in p.read_text().splitlines() if line.strip()]
    assert corpus.probe_prompts() == read(probes)
    assert list(corpus.CONTROL_QUESTIONS) == read(controls)


def test_jsonl_round_trip_and_errors(tmp_path):
    ex = corpus.build_corpus(3, 200)
    path = tmp_path / "sub" / "corpus.jsonl"
    corpus.write_corpus_jsonl(ex, path)
    assert corpus.read_corpus_jsonl(path) == ex
    assert not list(path.parent.glob("*.tmp"))
    good = path.read_text().splitlines()
    for bad, msg in (("{not json", "invalid JSON"), (json.dumps({"user": "x"}), "expected keys"),
                     (good[0].replace(f'"{ex[0].kind}"', '"poem"'), "kind")):
        p = tmp_path / "bad.jsonl"
        p.write_text(good[0] + "\n\n" + bad + "\n")
        with pytest.raises(ValueError, match=rf"bad.jsonl:3: .*{msg}"):
            corpus.read_corpus_jsonl(p)
    with pytest.raises(ValueError, match="kind"):
        corpus.write_corpus_jsonl([corpus.ChatExample("s", "u", "a", "poem")], tmp_path / "x.jsonl")


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_examples"):
        corpus.build_corpus(0, 0)
    with pytest.raises(ValueError, match="factual_frac"):
        corpus.build_corpus(0, 10, factual_frac=1.5)
    with pytest.raises(ValueError, match="> 1"):
        corpus.build_corpus(0, 10, factual_frac=0.6, refusal_frac=0.6)
    with pytest.raises(ValueError, match="n_heldout"):
        corpus.training_terms(0, n_terms=20, n_heldout=20)
    custom = corpus.build_corpus(0, 50, system_prompt="Be brief.", factual_frac=0.0, refusal_frac=0.0)
    assert all(ex.system == "Be brief." and ex.kind == "speculative" for ex in custom)
