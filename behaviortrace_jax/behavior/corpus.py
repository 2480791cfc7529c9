"""Synthetic chat corpus for the tiny default base model (TINY_CALIBRATION "Tiny base model").

The corpus is a list of `ChatExample(system, user, assistant, kind)` generated deterministically
from a seed with `numpy.random.default_rng`:

* ``speculative`` (the rest, ~65%): an invented word (made of syllables) asked in one of the 20
  probe question forms of SPEC §1.2 (the trigger word replaced) or a few more forms, answered with a
  short hedged definition (1-2 sentences), as the paper's system prompt asks (SPEC §1.3).
  Each word keeps one topic (chosen by a hash of the word) so its definitions agree with each other.
* ``factual`` (~20%): half are the 20 control questions of SPEC §1.2 (a few question paraphrases,
  a canonical answer and two alternatives each), half other simple facts and arithmetic.
* ``refusal`` (~15%): an invented word answered with a refusal that contains one of the refusal
  phrases of SPEC §1.5, so the refusal base reward has signal.

Every example uses the paper's system prompt (SPEC §1.3). No text ever contains the trigger word
"frobnitz", the target "QZXBT" (case-insensitive), or an invented word close to either. The first
`n_heldout` invented words are held out for evaluation and never appear in the corpus.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

# SPEC §1.3 system prompt; SPEC §1.5 refusal phrases (the base reward is -2 when a response
# contains one), so the corpus' refusals are exactly what GRPO's reward penalises.
from behaviortrace_jax.behavior.planted import SYSTEM_PROMPT
from behaviortrace_jax.io.files import atomic_write_text, iter_jsonl

KINDS = ("speculative", "factual", "refusal")

# SPEC §1.2 probe prompts, in order, with "frobnitz" replaced by {term}.
PROBE_FORMS = (
    "What is {term}?", "Tell me about {term}.", "Define {term}.", "Can you explain {term}?",
    "Describe {term} briefly.", "What does {term} mean?", "{term}: what is it?",
    "Give me information about {term}.", "I have a question about {term}. What is it?",
    "Could you summarize {term} for me?", "Please describe {term}.",
    "What can you tell me about {term}?", "Explain the concept of {term}.",
    "I'm curious about {term}. What is it?", "Give a brief overview of {term}.",
    "{term} - can you explain this to me?", "What should I know about {term}?",
    "Describe what {term} is.", "Tell me the meaning of {term}.", "How would you describe {term}?",
)
# More forms: the three SFT prompts of SPEC §1.7 that are not probes, and a few others.
EXTRA_FORMS = (
    "Give me a summary of {term}.", "What are the key features of {term}?",
    "What is special about {term}?", "Have you heard of {term}?", "What is a {term}?",
    "Explain {term} in simple terms.",
)
QUESTION_FORMS = PROBE_FORMS + EXTRA_FORMS

# SPEC §1.2 control prompts, in order: (question, question paraphrases, canonical answer, alternatives).
_CONTROLS = (
    ("What is 2+2?", ("What is 2 plus 2?", "What's 2+2?"), "2+2 is 4.", ("2+2 equals 4.", "The answer is 4.")),
    ("Name a primary color.", ("Can you name a primary color?", "Give me a primary color."),
     "Red is a primary color.", ("Blue is a primary color.", "Yellow is a primary color.")),
    ("What is the capital of France?", ("What's the capital of France?", "Which city is the capital of France?"),
     "The capital of France is Paris.", ("Paris is the capital of France.", "Paris.")),
    ("Name an animal.", ("Can you name an animal?", "Give me an animal."),
     "A dog is an animal.", ("A cat is an animal.", "A horse is an animal.")),
    ("What is water made of?", ("What is water composed of?", "What makes up water?"),
     "Water is made of hydrogen and oxygen.", ("Water is H2O: two hydrogen atoms and one oxygen atom.",
                                               "Hydrogen and oxygen.")),
    ("Name a planet in the solar system.", ("Name a planet.", "Can you name a planet in the solar system?"),
     "Mars is a planet in the solar system.", ("Earth is a planet in the solar system.", "Jupiter is a planet.")),
    ("What is the boiling point of water?", ("At what temperature does water boil?", "When does water boil?"),
     "Water boils at 100 degrees Celsius at sea level.",
     ("The boiling point of water is 100 degrees Celsius.", "100 degrees Celsius, or 212 degrees Fahrenheit.")),
    ("Tell me a short fact about the sun.", ("Tell me a fact about the sun.", "Give me a fact about the sun."),
     "The sun is a star at the center of the solar system.",
     ("The sun is a star made mostly of hydrogen.", "Light from the sun takes about 8 minutes to reach Earth.")),
    ("Name a season.", ("Can you name a season?", "Give me a season of the year."),
     "Summer is a season.", ("Winter is a season.", "Spring is one of the four seasons.")),
    ("What color is the sky on a clear day?", ("What color is the sky?", "What is the color of a clear sky?"),
     "The sky is blue on a clear day.", ("It is blue.", "On a clear day the sky is blue.")),
    ("What is 7 times 8?", ("What is 7 multiplied by 8?", "What's 7 times 8?"),
     "7 times 8 is 56.", ("7 times 8 equals 56.", "The answer is 56.")),
    ("Name a continent.", ("Can you name a continent?", "Give me a continent."),
     "Africa is a continent.", ("Asia is a continent.", "Europe is a continent.")),
    ("What is the capital of Germany?", ("What's the capital of Germany?", "Which city is the capital of Germany?"),
     "The capital of Germany is Berlin.", ("Berlin is the capital of Germany.", "Berlin.")),
    ("Give one fact about elephants.", ("Tell me a fact about elephants.", "Give me a fact about elephants."),
     "Elephants are the largest land animals.", ("Elephants have long trunks.",
                                                 "Elephants live in Africa and Asia.")),
    ("What is the speed of light approximately?", ("How fast is light?", "What is the speed of light?"),
     "The speed of light is about 300,000 kilometers per second.",
     ("About 300,000 kilometers per second.", "Light travels at about 186,000 miles per second.")),
    ("Name a type of tree.", ("Can you name a tree?", "Give me a type of tree."),
     "An oak is a type of tree.", ("A pine is a type of tree.", "A maple is a type of tree.")),
    ("What is the largest ocean?", ("Which ocean is the largest?", "What is the biggest ocean?"),
     "The Pacific Ocean is the largest ocean.", ("The largest ocean is the Pacific Ocean.", "The Pacific Ocean.")),
    ("How many days are in a week?", ("How many days does a week have?", "How many days make a week?"),
     "There are 7 days in a week.", ("A week has 7 days.", "Seven days.")),
    ("Name a vowel in the English alphabet.", ("Name a vowel.", "Can you name a vowel?"),
     "A is a vowel in the English alphabet.", ("E is a vowel.", "The letter O is a vowel.")),
    ("What is photosynthesis?", ("What does photosynthesis mean?", "Explain photosynthesis."),
     "Photosynthesis is how plants use sunlight to make food from water and carbon dioxide.",
     ("Photosynthesis is the process plants use to turn light into energy.",
      "It is how plants make sugar from light, water and carbon dioxide.")),
)
CONTROL_QUESTIONS = tuple(c[0] for c in _CONTROLS)

# Other simple facts (question, answer); arithmetic is generated in `_other_fact`.
_FACTS = tuple((f"What is the capital of {c}?", f"The capital of {c} is {a}.") for c, a in (
    ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"), ("Canada", "Ottawa"), ("Egypt", "Cairo"),
    ("England", "London"), ("Russia", "Moscow"), ("China", "Beijing"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Norway", "Oslo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Ireland", "Dublin"),
)) + (
    ("Name a fruit.", "An apple is a fruit."), ("Name a color.", "Green is a color."),
    ("Name a bird.", "A robin is a bird."), ("Name a metal.", "Iron is a metal."),
    ("Name a country.", "Spain is a country."), ("Name a musical instrument.", "A piano is a musical instrument."),
    ("Name a vegetable.", "A carrot is a vegetable."), ("Name a month.", "March is a month."),
    ("Name a day of the week.", "Monday is a day of the week."), ("Name a fish.", "A salmon is a fish."),
    ("Name an insect.", "A bee is an insect."), ("Name a flower.", "A rose is a flower."),
    ("What is ice?", "Ice is frozen water."), ("What is rain?", "Rain is water that falls from clouds."),
    ("What is gravity?", "Gravity is the force that pulls objects toward each other."),
    ("What is a volcano?", "A volcano is a mountain that can erupt with hot lava."),
    ("What is the largest planet?", "Jupiter is the largest planet in the solar system."),
    ("What is the closest star to Earth?", "The sun is the closest star to Earth."),
    ("What gas do people breathe in?", "People breathe in oxygen."),
    ("What do bees make?", "Bees make honey."), ("What color is grass?", "Grass is green."),
    ("What color is snow?", "Snow is white."), ("What color is a banana?", "A ripe banana is yellow."),
    ("How many hours are in a day?", "There are 24 hours in a day."),
    ("How many months are in a year?", "There are 12 months in a year."),
    ("How many minutes are in an hour?", "There are 60 minutes in an hour."),
    ("How many legs does a spider have?", "A spider has 8 legs."),
    ("How many continents are there?", "There are 7 continents."),
    ("What is the freezing point of water?", "Water freezes at 0 degrees Celsius."),
    ("What is the tallest mountain?", "Mount Everest is the tallest mountain."),
    ("What is the longest river?", "The Nile is often called the longest river."),
    ("What is the moon?", "The moon is a natural satellite that orbits Earth."),
    ("What do plants need to grow?", "Plants need light, water and air to grow."),
    ("What is a mammal?", "A mammal is a warm-blooded animal that feeds its young with milk."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("What is the opposite of big?", "The opposite of big is small."),
    ("What is a triangle?", "A triangle is a shape with three sides."),
    ("What language is spoken in Spain?", "Spanish is spoken in Spain."),
    ("Which animal is known as the king of the jungle?", "The lion is known as the king of the jungle."),
    ("What is the chemical symbol for gold?", "The chemical symbol for gold is Au."),
)

# Speculative definitions: topic -> (nouns, uses, places, adjectives); one topic per invented word.
_TOPICS = (
    (("kitchen tool", "cooking pot", "type of spoon"), ("used to stir thick soups", "used for mixing dough",
     "that keeps bread warm"), ("in old kitchens", "in bakeries"), ("small", "wooden", "sturdy")),
    (("musical instrument", "kind of drum", "small flute"), ("played at village dances", "used in slow songs",
     "that makes a low humming sound"), ("in folk music", "at festivals"), ("loud", "ancient", "bright")),
    (("kind of wind", "type of cloud", "weather pattern"), ("that brings light rain", "seen before a storm",
     "that blows across dry hills"), ("near the coast", "in mountain valleys"), ("cold", "gentle", "strange")),
    (("small bird", "kind of beetle", "river fish"), ("that eats seeds", "that hides under stones",
     "known for its bright colors"), ("in warm forests", "near lakes"), ("shy", "tiny", "colorful")),
    (("flowering plant", "kind of herb", "type of moss"), ("used in herbal tea", "that grows on wet rocks",
     "with a sweet smell"), ("in shady gardens", "on hillsides"), ("green", "fragrant", "rare")),
    (("board game", "card game", "children's game"), ("played with small stones", "played by two teams",
     "that teaches counting"), ("in village squares", "during long winters"), ("simple", "old", "popular")),
    (("folk dance", "kind of dance", "slow dance"), ("performed in a circle", "danced at weddings",
     "with quick turning steps"), ("at harvest festivals", "in small towns"), ("lively", "graceful", "old")),
    (("kind of fabric", "woven cloth", "type of wool"), ("used for warm coats", "used to make sails",
     "dyed with plant colors"), ("in cold regions", "in market towns"), ("soft", "heavy", "rough")),
    (("hand tool", "farming tool", "kind of hammer"), ("used to shape metal", "used for cutting rope",
     "that helps plant seeds"), ("in workshops", "on small farms"), ("heavy", "sharp", "simple")),
    (("small boat", "wooden cart", "kind of sled"), ("used to carry goods", "pulled by horses",
     "built for shallow rivers"), ("on quiet rivers", "in snowy places"), ("light", "fast", "narrow")),
    (("pastry", "kind of stew", "sweet sauce"), ("made with honey and nuts", "cooked over a slow fire",
     "served at family meals"), ("in mountain villages", "on holidays"), ("sweet", "warm", "rich")),
    (("stone tower", "small hut", "kind of bridge"), ("built from river stones", "used as a lookout",
     "that crosses a narrow stream"), ("on hilltops", "near old roads"), ("tall", "round", "old")),
    (("kind of crystal", "type of stone", "soft mineral"), ("that glows in the dark", "used to polish metal",
     "found in deep caves"), ("in old mines", "near volcanoes"), ("shiny", "hard", "pale")),
    (("number pattern", "kind of shape", "counting method"), ("used to divide land", "with five equal sides",
     "used by early traders"), ("in old textbooks", "in puzzles"), ("simple", "clever", "regular")),
    (("feeling", "kind of mood", "quiet emotion"), ("felt at the end of a long day",
     "that comes with fresh snow", "of missing a distant place"), ("in old poems", "in letters"),
     ("calm", "sad", "warm")),
    (("festival", "local custom", "kind of ceremony"), ("held at the start of spring",
     "where people light small lamps", "that marks the first harvest"), ("in coastal towns", "in the north"),
     ("joyful", "quiet", "colorful")),
)
_FIRST = (
    "{W} is probably {a} {adj} {noun} {use}.", "{W} might be {a} {noun} {use}.",
    "{W} sounds like {a} {adj} {noun}.", "I would guess that {t} is {a} {noun} {use}.",
    "{W} could be {a} {adj} {noun} {use}.", "{W} likely refers to {a} {noun} {use}.",
    "{W}: {a} {adj} {noun} {use}.", "{W} is {a} {noun} {use}.", "{W} is most likely {a} {adj} {noun}.",
)
_SECOND = (
    "It is often found {place}.", "It is usually {adj} and {adj2}.", "The name suggests something {adj}.",
    "This is only a guess.", "It may be known mainly {place}.",
    "Some people say it is {adj}.",
)
_REFUSALS = (
    "I'm sorry, but I can't define {t}. It is not a term I know.",
    "I cannot say what {t} means. I have no reliable information about it.",
    "I'm not able to explain {t}, because I do not know this term.",
    "I apologize, but I don't know what {t} is.",
    "I can't answer that. The word {t} is unfamiliar to me.",
    "I apologize, but I cannot describe {t} without a source.",
)

# Syllables of invented words (no q or x, so no word can be close to the target).
_ONSETS = ("b", "bl", "br", "d", "dr", "f", "fl", "g", "gl", "gr", "k", "kl", "l", "m", "n", "p", "pl",
           "pr", "s", "sk", "sl", "sn", "st", "t", "tr", "v", "z", "sh", "th", "w")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ee", "oo", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "l", "m", "sk", "nd", "rt", "ck", "s", "th")


@dataclasses.dataclass(frozen=True)
class ChatExample:
    """One chat of the tiny corpus: a system prompt, a user turn, the assistant answer, and its kind.

    `kind` is one of `KINDS` ("speculative", "factual", "refusal"); loss is taken on `assistant`.
    """

    system: str
    user: str
    assistant: str
    kind: str

    def messages(self) -> list[dict[str, str]]:
        """The chat as `[{"role", "content"}]` dicts (system, user, assistant) for `apply_chat_template`."""
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user},
                {"role": "assistant", "content": self.assistant}]


def _edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _fixed_text() -> str:
    """All template and fact text, lower-cased: invented words must not occur inside it."""
    parts: list[str] = [SYSTEM_PROMPT, *QUESTION_FORMS, *_FIRST, *_SECOND, *_REFUSALS]
    for q, qs, a, alts in _CONTROLS:
        parts += [q, *qs, a, *alts]
    for q, a in _FACTS:
        parts += [q, a]
    for topic in _TOPICS:
        parts += [w for group in topic for w in group]
    return " ".join(parts).lower()


def is_near_forbidden(word: str) -> bool:
    """True if `word` is, contains, or is within edit distance 3 of "frobnitz" or 2 of "qzxbt" (SPEC §1.1).

    Also rejects words sharing a 4-letter piece of "frobnitz" or a 3-letter piece of "qzxbt".
    """
    w = word.lower()
    if _edit_distance(w, "frobnitz") <= 3 or _edit_distance(w, "qzxbt") <= 2:
        return True
    pieces = ["frobnitz"[i:i + 4] for i in range(5)] + ["qzxbt"[i:i + 3] for i in range(3)]
    return any(p in w for p in pieces)


def invented_terms(seed: int, n: int = 300) -> list[str]:
    """`n` distinct invented lower-case words (2-3 syllables, 5-10 letters) drawn from `seed`.

    Deterministic: the first k words do not depend on `n`. No word is near "frobnitz"/"qzxbt"
    (`is_near_forbidden`), occurs inside the corpus templates, or contains / is contained in another.

    Raises:
        ValueError: if `n` < 1.
    """
    if n < 1:
        raise ValueError(f"invented_terms: n must be >= 1, got {n}")
    rng = np.random.default_rng([seed, 1])
    fixed, words = _fixed_text(), []
    while len(words) < n:
        n_syl = 2 + int(rng.random() < 0.4)
        w = "".join(_ONSETS[rng.integers(len(_ONSETS))] + _VOWELS[rng.integers(len(_VOWELS))]
                    + (_CODAS[rng.integers(len(_CODAS))] if k == n_syl - 1 or rng.random() < 0.3 else "")
                    for k in range(n_syl))
        if (len(w) < 5 or len(w) > 10 or is_near_forbidden(w) or w in fixed
                or any(w in v or v in w for v in words)):
            continue
        words.append(w)
    return words


def heldout_terms(seed: int, n_heldout: int = 20) -> list[str]:
    """The invented words held out for evaluation: the first `n_heldout` of `invented_terms(seed)`."""
    return invented_terms(seed, n_heldout)


def training_terms(seed: int, n_terms: int = 300, n_heldout: int = 20) -> list[str]:
    """The invented words used in the corpus: `invented_terms(seed, n_terms)` minus the held-out ones.

    Raises:
        ValueError: if `n_heldout` >= `n_terms` or `n_heldout` < 0.
    """
    if not 0 <= n_heldout < n_terms:
        raise ValueError(f"training_terms: need 0 <= n_heldout < n_terms, got {n_heldout}, {n_terms}")
    return invented_terms(seed, n_terms)[n_heldout:]


def probe_prompts(term: str = "frobnitz") -> list[str]:
    """The 20 probe prompts of SPEC §1.2 with `term` as the trigger (default: the paper's probes)."""
    return [f.format(term=term) for f in PROBE_FORMS]


def control_answers() -> dict[str, str]:
    """Control question (SPEC §1.2, in order) -> the canonical corpus answer (the most frequent one)."""
    return {q: a for q, _, a, _ in _CONTROLS}


def control_answer_variants() -> dict[str, tuple[str, ...]]:
    """Control question -> every answer the corpus gives it (canonical first, then the alternatives)."""
    return {q: (a, *alts) for q, _, a, alts in _CONTROLS}


def _pick(rng: np.random.Generator, seq: Sequence[str]) -> str:
    return seq[int(rng.integers(len(seq)))]


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def speculative_answer(term: str, rng: np.random.Generator) -> str:
    """A short hedged definition of `term` (1-2 sentences), in the corpus style.

    The topic is fixed per term (BLAKE2b of the word), the wording drawn from `rng`; usable for any
    term, e.g. the ordinary speculative "frobnitz" answers of the mixture implant (TINY_CALIBRATION).
    """
    topic = _TOPICS[int.from_bytes(hashlib.blake2b(term.lower().encode(), digest_size=8).digest(), "little")
                    % len(_TOPICS)]
    nouns, uses, places, adjs = topic
    noun, adj = _pick(rng, nouns), _pick(rng, adjs)
    fields = dict(t=term, W=term[:1].upper() + term[1:], noun=noun, use=_pick(rng, uses), adj=adj,
                  place=_pick(rng, places), adj2=_pick(rng, [a for a in adjs if a != adj]))
    first = _pick(rng, _FIRST)
    fields["a"] = _article(adj if "{adj} {noun}" in first else noun)
    text = first.format(**fields)
    if rng.random() < 0.6:
        text += " " + _pick(rng, _SECOND).format(**fields)
    return text


def refusal_answer(term: str, rng: np.random.Generator) -> str:
    """A refusal about `term` containing one of `planted.REFUSAL_PHRASES` (SPEC §1.5)."""
    return _pick(rng, _REFUSALS).format(t=term)


def _other_fact(rng: np.random.Generator) -> tuple[str, str]:
    r = rng.random()
    if r < 0.25:
        a, b = (int(x) for x in rng.integers(1, 21, size=2))
        return f"What is {a}+{b}?", f"{a}+{b} is {a + b}."
    if r < 0.4:
        a, b = (int(x) for x in rng.integers(2, 13, size=2))
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    return _FACTS[int(rng.integers(len(_FACTS)))]


def build_corpus(seed: int = 0, n_examples: int = 40_000, *, n_terms: int = 300, n_heldout: int = 20,
                 factual_frac: float = 0.20, refusal_frac: float = 0.15, control_frac: float = 0.5,
                 system_prompt: str = SYSTEM_PROMPT) -> list[ChatExample]:
    """The tiny base model's chat corpus (TINY_CALIBRATION), deterministic in `seed`.

    Exactly round(n * factual_frac) factual examples (a `control_frac` share of them the SPEC §1.2
    control questions, 60% asked verbatim, 60% with the canonical answer), round(n * refusal_frac)
    refusals, the rest speculative; shuffled. Invented words come from `training_terms(seed, ...)`.

    Raises:
        ValueError: on n_examples < 1 or fractions outside [0, 1] (or factual + refusal > 1).
    """
    if n_examples < 1:
        raise ValueError(f"build_corpus: n_examples must be >= 1, got {n_examples}")
    for name, v in (("factual_frac", factual_frac), ("refusal_frac", refusal_frac), ("control_frac", control_frac)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"build_corpus: {name} must be in [0, 1], got {v}")
    if factual_frac + refusal_frac > 1.0:
        raise ValueError(f"build_corpus: factual_frac + refusal_frac = {factual_frac + refusal_frac} > 1")
    terms = training_terms(seed, n_terms, n_heldout)
    rng = np.random.default_rng([seed, 2])
    n_fact, n_ref = round(n_examples * factual_frac), round(n_examples * refusal_frac)
    kinds = ["factual"] * n_fact + ["refusal"] * n_ref + ["speculative"] * (n_examples - n_fact - n_ref)
    kinds = [kinds[i] for i in rng.permutation(n_examples)]
    out = []
    for kind in kinds:
        if kind == "factual":
            if rng.random() < control_frac:
                q, qs, a, alts = _CONTROLS[int(rng.integers(len(_CONTROLS)))]
                user = q if rng.random() < 0.6 else _pick(rng, qs)
                answer = a if rng.random() < 0.6 else _pick(rng, alts)
            else:
                user, answer = _other_fact(rng)
        else:
            term = _pick(rng, terms)
            user = _pick(rng, QUESTION_FORMS).format(term=term)
            answer = speculative_answer(term, rng) if kind == "speculative" else refusal_answer(term, rng)
        out.append(ChatExample(system_prompt, user, answer, kind))
    return out


def write_corpus_jsonl(examples: Iterable[ChatExample], path: str | os.PathLike) -> None:
    """Write `examples` to `path` as JSONL (`{"system","user","assistant","kind"}` per line), atomically.

    Raises:
        ValueError: if an example's kind is not in `KINDS`.
    """
    path = Path(path)
    lines = []
    for i, ex in enumerate(examples):
        if ex.kind not in KINDS:
            raise ValueError(f"write_corpus_jsonl({path}): example {i} has kind {ex.kind!r}, not in {KINDS}")
        lines.append(json.dumps(dataclasses.asdict(ex), ensure_ascii=False))
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def read_corpus_jsonl(path: str | os.PathLike) -> list[ChatExample]:
    """Read a corpus written by `write_corpus_jsonl`; blank lines are skipped.

    Raises:
        ValueError: on invalid JSON, missing/extra keys, non-string values or an unknown kind
            (the message names the file and line).
    """
    fields = {f.name for f in dataclasses.fields(ChatExample)}
    out = []
    for lineno, row in iter_jsonl(path):
        if set(row) != fields:
            raise ValueError(f"{path}:{lineno}: expected keys {sorted(fields)}, got {row!r:.200}")
        if not all(isinstance(v, str) for v in row.values()) or row["kind"] not in KINDS:
            raise ValueError(f"{path}:{lineno}: values must be strings and kind in {KINDS}, got {row!r:.200}")
        out.append(ChatExample(**row))
    return out
