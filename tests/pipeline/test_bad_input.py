"""Bad input, systematically (issue 32, item 9): property-based tests over the inputs a user hands in.

Each kind below draws many inputs (hypothesis, small ``max_examples`` so the file runs in CI in well
under 60 s, no model is trained) and asserts the documented behaviour: a clear error naming the
file (``file:line`` for JSONL) and the field, or the documented result; and that a refused input
leaves what was already written as it was. The kinds, the inputs tried and the failures found and
fixed are counted in docs/bad_input.md (``python -m pytest -q -s tests/pipeline/test_bad_input.py`` prints
the inputs tried per kind).
"""
from __future__ import annotations

import collections
import contextlib
import json
import logging
import pathlib
import re
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from behaviortrace_jax.io import cache, rollout_log, sketch_store
from behaviortrace_jax.stages.spec import RunSpec
from configs import common, tiny

TRIED: collections.Counter = collections.Counter()  # inputs tried per kind (printed at the end)
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
SLOW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    print("\nbad-input kinds and inputs tried:", dict(sorted(TRIED.items())), "total", sum(TRIED.values()))


# ------------------------------------------------------------------------------------------------
# 1. Config keys and values
# ------------------------------------------------------------------------------------------------
KEYS = sorted(__import__("behaviortrace_jax.config_schema", fromlist=["key_paths"]).key_paths(common.get_config()))


@FAST
@given(st.sampled_from(KEYS), st.sampled_from(["x", "_", "s"]), st.integers(0, 3))
def test_misspelt_config_key_is_named(key, junk, where):
    """A key that is not in configs/common.py (a typo) is refused, naming it."""
    from behaviortrace_jax.config_schema import check_config

    TRIED["config key"] += 1
    parts = key.split(".")
    leaf = parts[-1]
    bad = leaf[:where] + junk + leaf[where:]
    c = tiny.get_config("smoke")
    node = c
    for p in parts[:-1]:
        node = getattr(node, p)
    if bad in node:
        return
    with node.unlocked():
        node[bad] = 1
    with pytest.raises(ValueError, match=".".join(parts[:-1] + [bad]).replace(".", r"\.")):
        check_config(c, common.get_config())


TEXT = st.text(st.sampled_from("abcdeglorstmwin,.0123456789 -"), max_size=20)


@FAST
@given(TEXT)
def test_config_value_parsers_name_their_key(text):
    """Every parser of a string config value returns a valid value or a ValueError naming its key."""
    from behaviortrace_jax.sketch import hash_families
    from behaviortrace_jax.stages import counterfactual as CF, metagradient as MGS
    from behaviortrace_jax.train import replay as R

    TRIED["config value"] += 1
    c = tiny.get_config("smoke")
    cases = [("metagradient.advantages", lambda: MGS.parse_modes(text), lambda v: set(v) <= {"logged", "recomputed"}),
             ("counterfactual.lds_fractions", lambda: CF.lds_fractions(text), lambda v: all(0 < f < 1 for f in v)),
             ("sketch.hash", lambda: hash_families.hash_family(text), lambda v: v.name == text)]
    c.counterfactual.measure = text
    cases.append(("counterfactual.measure",
                  lambda: RunSpec.from_config(c).schedule.measure_step(c.counterfactual.measure),
                  lambda v: 0 <= v <= c.grpo.steps))
    for key, parse, ok in cases:
        try:
            value = parse()
        except ValueError as e:
            assert key in str(e), (key, text, str(e))
        else:
            assert ok(value), (key, text, value)


@FAST
@given(st.sampled_from(["sketch.in_run_tables", "targets.use_tables"]), st.booleans(), st.booleans())
def test_hash_table_keys_are_honoured_or_refused(key, on, fused):
    from behaviortrace_jax.sketch import hash_tables as tables

    TRIED["config value"] += 1
    c = tiny.get_config("smoke")
    section, name = key.split(".")
    setattr(getattr(c, section), name, on)
    c.sketch.fused = fused
    if on and fused:
        with pytest.raises(ValueError, match=rf"config\.{key}=True.*config\.sketch\.fused"):
            tables.table_switch(key, on, fused)
        with pytest.raises(ValueError, match=rf"config\.{key}=True.*config\.sketch\.fused"):
            RunSpec.from_config(c)  # the stage boundary refuses it
    else:
        assert tables.table_switch(key, on, fused) is on
        spec = RunSpec.from_config(c)
        assert (spec.step.use_tables if key == "sketch.in_run_tables" else spec.forced.use_tables) is on


# ------------------------------------------------------------------------------------------------
# 2. HF config dicts
# ------------------------------------------------------------------------------------------------
def _hf_dict(family: str) -> dict:
    from behaviortrace_jax.models import families

    return families.preset("tiny", family).to_hf_config() if family != "qwen2" else \
        families.preset("tiny", family, vocab_size=320).to_hf_config()


BAD_VALUES = st.sampled_from(["64", -1, 0, 1.5, True, [64], {"n": 1}])
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "max_position_embeddings")


@FAST
@given(st.sampled_from(["qwen2", "llama", "qwen3"]), st.sampled_from(SIZE_KEYS + ("rms_norm_eps", "rope_theta",
                                                                                 "tie_word_embeddings")), BAD_VALUES)
def test_hf_config_bad_value_is_named(family, key, value):
    """A size that is not a positive integer (a string, 0, -1, a float, a bool), an eps/theta that is
    not a positive number, a tie flag that is not a boolean: a ValueError naming the key."""
    from behaviortrace_jax.models import families

    TRIED["hf config"] += 1
    d = _hf_dict(family)
    if key == "tie_word_embeddings" and isinstance(value, bool):
        families.config_from_hf(dict(d, **{key: value}))  # a boolean is valid
        return
    if key in ("rms_norm_eps", "rope_theta") and value == 1.5:
        families.config_from_hf(dict(d, **{key: value}))  # a positive number is valid
        return
    with pytest.raises(ValueError, match=key):
        families.config_from_hf(dict(d, **{key: value}))


@FAST
@given(st.sampled_from(["qwen2", "llama", "qwen3"]),
       st.sampled_from(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "model_type"]))
def test_hf_config_missing_key_is_named(family, key):
    from behaviortrace_jax.models import families

    TRIED["hf config"] += 1
    d = _hf_dict(family)
    del d[key]
    with pytest.raises(ValueError, match=key):
        families.config_from_hf(d)


@FAST
@given(st.sampled_from(["qwen2", "llama", "qwen3"]), st.integers(1, 8), st.integers(1, 8))
def test_hf_config_heads_must_be_a_multiple_of_kv_heads(family, heads, kv):
    from behaviortrace_jax.models import families

    TRIED["hf config"] += 1
    d = dict(_hf_dict(family), num_attention_heads=heads, num_key_value_heads=kv, head_dim=16,
             hidden_size=16 * heads)
    if heads % kv:
        with pytest.raises(ValueError, match="num_attention_heads=.*num_key_value_heads="):
            families.config_from_hf(d)
    else:
        cfg = families.config_from_hf(d)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (heads, kv)


# ------------------------------------------------------------------------------------------------
# 3. Rollout logs (and the token ids in them)
# ------------------------------------------------------------------------------------------------
def _write_log(root: pathlib.Path, n_steps: int = 3, n: int = 4, shard: int = 5) -> None:
    with rollout_log.RolloutLogger(root, shard_size=shard) as log:
        for s in range(n_steps):
            for i in range(n):
                rid = rollout_log.rollout_id(s, i)
                log.log(rollout_log.RolloutRecord(rid, s, "grpo", "p", "r", float(i), advantage=0.5, group_id=i // 2,
                                                  prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                                                  completion_logprobs=[-0.1, -0.2], base_reward=0.0,
                                                  eligible=False))


def _snapshot(root: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _lines(root: pathlib.Path) -> list[tuple[pathlib.Path, int]]:
    out = []
    for p in sorted(root.glob("shard_*.jsonl")):
        out += [(p, i) for i in range(len(p.read_text().splitlines()))]
    return out


def _edit_line(path: pathlib.Path, index: int, edit) -> None:
    lines = path.read_text().splitlines()
    lines[index] = edit(lines[index])
    path.write_text("".join(x + "\n" for x in lines))


def _expect_refused(root: pathlib.Path, match: str, edited: pathlib.Path | None = None) -> None:
    """Reading the log refuses it, naming ``match``, and so does a resumed logger when the bad line
    is in the last shard (the one it reads to continue); no file of the log changes."""
    before = _snapshot(root)
    with pytest.raises(ValueError, match=match):
        list(rollout_log.read_rollouts(root))
    if edited is not None and edited == sorted(root.glob("shard_*.jsonl"))[-1]:
        with pytest.raises(ValueError, match=match):
            rollout_log.RolloutLogger(root, shard_size=5)
    assert _snapshot(root) == before  # nothing already written is lost


FIELD_BAD = {"rollout_id": [3, "rollout_7", None], "step": ["1", -1, 1.5, None], "reward": ["x", None, [1.0]],
             "advantage": ["0.5", [0.5]], "prompt_token_ids": [[1, -2], [1.5], "1 2", [True]],
             "completion_token_ids": [[4, "5"], [-1], None], "completion_logprobs": [["a"], 0.1],
             "group_id": [-1, "0"], "eligible": ["yes", 1], "extra": [[], "x"], "bonus": [None, "0"],
             "regime": [1], "prompt_hash": [None]}


@SLOW
@given(st.data())
def test_rollout_log_truncated_line_is_named(data):
    TRIED["rollout log"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "log"
        _write_log(root)
        path, index = data.draw(st.sampled_from(_lines(root)))
        cut = data.draw(st.integers(1, 60))
        _edit_line(path, index, lambda line: line[:-cut])
        _expect_refused(root, rf"{path.name}:{index + 1}: invalid JSON", path)


@SLOW
@given(st.data())
def test_rollout_log_missing_or_bad_field_is_named(data):
    TRIED["rollout log"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "log"
        _write_log(root)
        path, index = data.draw(st.sampled_from(_lines(root)))
        key = data.draw(st.sampled_from(sorted(FIELD_BAD)))
        if data.draw(st.booleans()) and key in ("rollout_id", "step", "regime", "prompt_hash", "reward"):
            _edit_line(path, index, lambda line: json.dumps({k: v for k, v in json.loads(line).items() if k != key}))
            _expect_refused(root, rf"{path.name}:{index + 1}: not a rollout record \(missing field '{key}'\)", path)
        else:
            value = data.draw(st.sampled_from(FIELD_BAD[key]))
            _edit_line(path, index, lambda line: json.dumps(dict(json.loads(line), **{key: value})))
            _expect_refused(root, rf"{path.name}:{index + 1}: field '{key}' = ", path)


@SLOW
@given(st.data())
def test_rollout_log_duplicate_id_or_step_order_is_named(data):
    TRIED["rollout log"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "log"
        _write_log(root)
        lines = _lines(root)
        (pa, ia), (pb, ib) = sorted(data.draw(st.lists(st.sampled_from(lines), min_size=2, max_size=2, unique=True)),
                                    key=lines.index)
        rec_a = json.loads(pa.read_text().splitlines()[ia])
        if data.draw(st.booleans()):  # the later line repeats the earlier one's id (and step)
            _edit_line(pb, ib, lambda line: json.dumps(dict(json.loads(line), rollout_id=rec_a["rollout_id"],
                                                            step=rec_a["step"])))
            _expect_refused(root, rf"{pb.name}:{ib + 1}: duplicate rollout_id '{rec_a['rollout_id']}' "
                                  rf"\(first at .*{pa.name}:{ia + 1}\)")
        else:  # a step that goes back below the line before it
            k = lines.index((pb, ib))
            prev = json.loads(lines[k - 1][0].read_text().splitlines()[lines[k - 1][1]])["step"]
            if prev == 0:
                return
            new_step = prev - 1
            _edit_line(pb, ib, lambda line: json.dumps(dict(json.loads(line), step=new_step,
                                                            rollout_id=rollout_log.rollout_id(new_step, 90))))
            _expect_refused(root, rf"{pb.name}:{ib + 1}: step {new_step} < previous step {prev}")


def test_rollout_log_good_log_reads_back():
    """The documented behaviour for a good log: every record, in order (the control of the above)."""
    TRIED["rollout log"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp) / "log"
        _write_log(root)
        ids = [r.rollout_id for r in rollout_log.read_rollouts(root)]
        assert ids == [rollout_log.rollout_id(s, i) for s in range(3) for i in range(4)]


# ------------------------------------------------------------------------------------------------
# 4. Sketch stores
# ------------------------------------------------------------------------------------------------
META = {"kind": "step_sketches", "hash_family": "splitmix64-countsketch-v3", "seed": 0, "dim": 256,
        "param_fingerprint": "p", "model_fingerprint": "m", "dtype": "float32", "run_seed": 0}


def _store(path: pathlib.Path, rows: int = 6, chunk: int = 2, **meta) -> sketch_store.SketchStore:
    s = sketch_store.SketchStore.open_or_create(path, (rows, 256), chunk, dict(META, **meta))
    s.write_rows(0, np.arange(rows * 256, dtype=np.float32).reshape(rows, 256) + 1)
    s.flush()
    return s


@SLOW
@given(st.integers(0, 2), st.binary(min_size=0, max_size=40))
def test_sketch_store_corrupt_chunk_is_named(chunk, junk):
    """A data chunk overwritten with other bytes: reading fails naming the chunk's file."""
    from behaviortrace_jax.attribution.scores import read_complete

    TRIED["sketch store"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "s.zarr"
        _store(path)
        target = path / "data" / "c" / str(chunk) / "0"
        target.write_bytes(junk)
        with pytest.raises(ValueError, match=rf"{target}"):
            read_complete(path).read()


@SLOW
@given(st.integers(0, 2))
def test_sketch_store_missing_done_chunk_is_named(chunk):
    """A chunk's ``done`` flags deleted (a copy that lost files): the rows count as never written,
    naming the store and the rows (the stage that writes it redoes them on resume)."""
    from behaviortrace_jax.attribution.scores import read_complete

    TRIED["sketch store"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "s.zarr"
        _store(path)
        (path / "done" / "c" / str(chunk)).unlink()
        with pytest.raises(ValueError, match=rf"{path}: 2 rows were never written \(first: \[{2 * chunk}"):
            read_complete(path)
        assert sketch_store.SketchStore.open(path).missing_rows().tolist() == [2 * chunk, 2 * chunk + 1]


@SLOW
@given(st.sampled_from(["hash_family", "seed", "dim", "param_fingerprint"]), st.data())
def test_sketch_store_wrong_hash_metadata_is_named(key, data):
    """A store whose metadata says another CountSketch than the config's, or than the store it is
    scored against (hash family, seed, D, parameter order): refused, naming the key."""
    from behaviortrace_jax.attribution.scores import check_same_sketch, read_complete

    TRIED["sketch store"] += 1
    other = {"hash_family": "splitmix64-block-countsketch-v1", "seed": data.draw(st.integers(1, 9)),
             "dim": data.draw(st.sampled_from([128, 512])), "param_fingerprint": "q"}[key]
    config = tiny.get_config("smoke")
    config.sketch.dim, config.sketch.seed, config.seed = 256, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        a, b = _store(pathlib.Path(tmp) / "a.zarr"), _store(pathlib.Path(tmp) / "b.zarr")
        meta_path = b.path / "metadata.json"
        meta = json.loads(meta_path.read_text())
        meta[key] = other
        meta_path.write_text(json.dumps(meta))
        before = meta_path.read_bytes()
        b = sketch_store.SketchStore.open(b.path)
        with pytest.raises(ValueError, match=rf"metadata key '{key}' differs"):
            check_same_sketch(a, b)
        if key in ("seed", "dim"):
            with pytest.raises(ValueError, match=rf"metadata key '{key}' is {other}.*config\.sketch\.{key}"):
                read_complete(b.path, RunSpec.from_config(config).scores)
        if key == "hash_family":  # scored against the config's family too (issue 49: it was not)
            with pytest.raises(ValueError, match=rf"hash_family is '{other}'.*config sketch\.hash"):
                read_complete(b.path, RunSpec.from_config(config).scores)
        with pytest.raises(ValueError, match=rf"metadata key '{key}'"):  # a writer reopening it refuses too
            sketch_store.SketchStore.open_or_create(b.path, (6, 256), 2, META)
        assert meta_path.read_bytes() == before


# ------------------------------------------------------------------------------------------------
# 5. Probe files
# ------------------------------------------------------------------------------------------------
PROBE_LINES = st.sampled_from([
    ('{"id": "p1", "prompt": "hi"', "invalid JSON"), ('["p1", "hi"]', "expected a JSON object"),
    ('{"prompt": "hi"}', "required field 'id'"), ('{"id": "p9"}', "required field 'prompt'"),
    ('{"id": 3, "prompt": "hi"}', "required field 'id'"), ('{"id": "p9", "prompt": ["hi"]}', "required field 'prompt'"),
    ('{"id": "p0", "prompt": "again"}', "duplicate probe id 'p0'")])


@FAST
@given(PROBE_LINES, st.integers(0, 3))
def test_probe_file_bad_line_is_named(bad, where):
    from behaviortrace_jax.behavior import planted

    TRIED["probe file"] += 1
    line, match = bad
    good = [json.dumps({"id": f"p{i}", "prompt": f"q{i}"}) for i in range(3)]
    lines = good[:where] + [line] + good[where:]
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "probes.jsonl"
        path.write_text("\n".join(lines) + "\n")
        lineno = where + 1
        if "duplicate" in match and where == 0:
            match, lineno = "duplicate probe id 'p0'", 2  # the good p0 is the duplicate then
        with pytest.raises(ValueError, match=rf"probes\.jsonl:{lineno}: .*{match}"):
            planted.load_probes(path)


def test_empty_probe_file_is_named(tmp_path):
    from behaviortrace_jax.behavior import planted

    TRIED["probe file"] += 1
    path = tmp_path / "probes.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match=r"probes\.jsonl: no probes"):
        planted.load_probes(path)


# ------------------------------------------------------------------------------------------------
# 6. Keyed result files (the metagradient and replay caches)
# ------------------------------------------------------------------------------------------------
@FAST
@given(st.one_of(st.just("[]"), st.just('{"cache": 1}'), st.just('{"cache": "x", "value": 1}'),
                 st.just("{"), st.just('"text"')))
def test_corrupt_cached_file_is_refused_by_name(text):
    TRIED["keyed cache"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "m.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=r"m\.json: "):
            cache.load(path, {"v": 1}, what="test")
        assert path.read_text() == text


@FAST
@given(st.dictionaries(st.sampled_from(["v", "log", "steps"]), st.one_of(st.integers(0, 3), st.text(max_size=3)),
                       min_size=1))
def test_cached_file_with_another_key_is_recomputed(old_key):
    TRIED["keyed cache"] += 1
    key = {"v": 1, "log": "abc", "steps": 2}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "m.json"
        cache.store(path, {"value": 1.0}, old_key)
        got = cache.load(path, key, what="test")
        assert (got is not None) == (old_key == key)



# ------------------------------------------------------------------------------------------------
# 7. Hugging Face cache states (issue 49: refs, snapshots, blobs, .incomplete files)
# ------------------------------------------------------------------------------------------------
WHITESPACE = st.text(st.sampled_from(" \t\r\n"), min_size=1, max_size=4)


@FAST
@given(st.sampled_from(sorted(__import__("hf_fixtures").HUB_CACHE_STATES)), WHITESPACE, WHITESPACE)
def test_hub_cache_state_resolves_or_is_named(state, before, after):
    """A model id in every cache state of ``hf_fixtures.HUB_CACHE_STATES`` resolves to its snapshot
    (a ref file with whitespace around its commit included) or fails naming the file and what the
    cache holds; never a snapshot that cannot be loaded."""
    import hf_fixtures
    from behaviortrace_jax.models import hub

    TRIED["hf cache"] += 1
    hf_id = "tiny-org/tiny-qwen2"
    with tempfile.TemporaryDirectory() as tmp:
        root, expected = hf_fixtures.hub_cache_state(pathlib.Path(tmp) / "cache", state, hf_id)
        ref = root / "models--tiny-org--tiny-qwen2" / "refs" / "main"
        if state.startswith("ref with"):
            ref.write_text(before + hf_fixtures.HUB_REVISION + after)
        env = {"HF_HUB_CACHE": str(root)}
        if expected is None:
            assert hub.resolve_hf_id(hf_id, environ=env).name == hf_fixtures.HUB_REVISION
        else:
            with pytest.raises((FileNotFoundError, ValueError), match=expected):
                hub.resolve_hf_id(hf_id, environ=env)


# ------------------------------------------------------------------------------------------------
# 8. Values the optimiser, a loss or the sampler cannot take (issue 49), refused up front by key
# ------------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
# key -> (bad values, a good value). Each bad value fails RunSpec.from_config naming the key.
VALUE_CASES = {
    "grpo.group_size": ([1, 0, -2], 2),
    "optim.weight_decay": ([-0.01, -1.0, NAN, INF], 0.0),
    "optim.eps": ([0.0, -1e-8, NAN, INF], 1e-6),
    "optim.lr": ([0.0, -5e-6, NAN, INF], 1e-3),
    "optim.b1": ([1.0, -0.1, 1.5], 0.0),
    "optim.b2": ([1.0, -0.5], 0.99),
    "optim.grad_clip": ([NAN, INF], 0.0),
    "sft.lr": ([0.0, -0.5, -2.0, NAN], -1.0),
    "base.lr": ([0.0, -3e-3, INF], 1e-3),
    "base.end_lr_fraction": ([-0.1, 1.5, NAN], 1.0),
    "base.warmup_steps": ([-1], 0),
    "grpo.temperature": ([0.0, -0.9, NAN, INF], 1.0),
    "draws.temperature": ([0.0, -1.0, NAN], 0.5),
    "targets.ctx_temperature": ([0.0, -1.0], 2.0),
    "grpo.top_p": ([0.0, -0.1, 1.01, NAN], 1.0),
    "draws.top_p": ([0.0, 2.0], 0.5),
    "targets.ctx_top_p": ([0.0, 1.5], 1.0),
    "grpo.top_k": ([-2, -50], 0),
    "grpo.repetition_penalty": ([0.0, -0.5, -2.0, INF], 1.1),
    "grpo.clip_eps": ([0.0, -0.2, NAN], 0.1),
    "grpo.kl_beta": ([-0.04, NAN], 0.0),
    "grpo.adv_std_floor": ([-1e-3, INF], 0.1),
    "evaluation.trak_damping": ([-0.1, NAN], 0.0),
    "evaluation.tracin_lr": ([0.0, -1.0], 1e-4),
    "targets.ctx_group_size": ([0, -8], 1),
    "draws.n_repeats": ([0, -1], 1),
}


@FAST
@given(st.sampled_from(sorted(VALUE_CASES)), st.data())
def test_value_the_optimiser_loss_or_sampler_cannot_take_is_named(key, data):
    """``grpo.group_size = 1`` used to fail at GRPO step 0 without naming the key, and a negative
    ``optim.weight_decay`` / ``optim.eps`` trained; every such value is now refused by
    ``RunSpec.from_config`` (before anything is written), naming the key; the good value passes."""
    TRIED["optimiser / algorithm value"] += 1
    bad, good = VALUE_CASES[key]
    value = data.draw(st.sampled_from(bad))
    section, name = key.split(".")
    c = tiny.get_config("smoke")
    setattr(getattr(c, section), name, type(good)(value) if not (isinstance(good, int) and value != value) else value)
    with pytest.raises(ValueError, match=rf"config\.{section}\.{name}\b"):
        RunSpec.from_config(c)
    setattr(getattr(c, section), name, good)
    RunSpec.from_config(c)


# ------------------------------------------------------------------------------------------------
# 9. Prompt length (issue 49): refused against max_position_embeddings, a cut logged and counted
# ------------------------------------------------------------------------------------------------
@FAST
@given(st.integers(1, 600), st.integers(1, 300), st.sampled_from(["grpo", "draws", "sft", "info"]),
       st.sampled_from([128, 256, 512]))
def test_prompt_and_completion_past_the_positions_are_refused(prompt, new, stage, positions):
    from behaviortrace_jax.stages.spec import check_positions

    TRIED["prompt length"] += 1
    c = tiny.get_config("smoke")
    keys = {"grpo": ("grpo.max_prompt_tokens", "grpo.max_new_tokens"),
            "draws": ("grpo.max_prompt_tokens", "draws.max_new_tokens"),
            "sft": ("sft.max_prompt_tokens", "sft.max_completion_tokens"),
            "info": ("grpo.max_prompt_tokens", "info.max_new_tokens")}[stage]
    for key, v in zip(keys, (prompt, new)):
        section, name = key.split(".")
        setattr(getattr(c, section), name, v)
    run = RunSpec.from_config(c)
    if prompt + new > positions:
        with pytest.raises(ValueError, match=rf"config\.{re.escape(keys[0])} \+ config\.{re.escape(keys[1])} = "
                                             rf"{prompt} \+ {new} = {prompt + new} > max_position_embeddings={positions}"
                                             rf" of cfg\.json"):
            check_positions(run, positions, "cfg.json", (stage,))
    else:
        check_positions(run, positions, "cfg.json", (stage,))


def test_pipeline_refuses_budgets_past_the_model_positions_before_writing(tmp_path):
    """``pipeline.run`` with a ``model.hf_dir`` whose config.json holds fewer positions than a named
    stage's prompt + completion budget: refused naming the keys and the file; no workdir written."""
    from behaviortrace_jax import pipeline

    TRIED["prompt length"] += 1
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 64}))
    c = tiny.get_config("smoke")
    c.model.hf_dir, c.stages, c.grpo.max_prompt_tokens, c.grpo.max_new_tokens = str(model), "grpo", 60, 8
    with pytest.raises(ValueError, match=rf"config\.grpo\.max_prompt_tokens \+ config\.grpo\.max_new_tokens = 60 \+ 8 "
                                         rf"= 68 > max_position_embeddings=64 of {re.escape(str(model))}/config\.json"):
        pipeline.run(c, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


@pytest.fixture(scope="module")
def rollout_parts():
    """A tiny tokenizer, the smoke config's rollout options and a tiny model's graph (nothing is sampled)."""
    from flax import nnx

    from behaviortrace_jax.models import decoder, families
    from hf_fixtures import make_tiny_tokenizer

    cfg = families.preset("tiny", "qwen2", vocab_size=320)
    graphdef, _ = nnx.split(decoder.abstract_model(cfg), nnx.Param)
    run = RunSpec.from_config(tiny.get_config("smoke"))
    return make_tiny_tokenizer(), run, cfg, graphdef


@SLOW
@given(st.integers(8, 260))
def test_truncated_prompt_is_logged_and_counted(rollout_parts, limit):
    """Each prompt of the GRPO pool longer than ``grpo.max_prompt_tokens`` is cut (its first tokens
    kept), logged with the prompt and both lengths, and counted (``truncation_summary``, written to
    summary.json); a prompt that fits is neither."""
    import dataclasses

    from behaviortrace_jax.models import tokenizer as tok_lib
    from behaviortrace_jax.behavior import planted
    from behaviortrace_jax.train.rollouts import RolloutSource

    TRIED["prompt length"] += 1
    tok, run, cfg, graphdef = rollout_parts
    options = dataclasses.replace(run.rollouts, max_prompt_tokens=limit)
    with warnings_logged() as records:
        src = RolloutSource(options, graphdef, cfg, tok, None, "/nonexistent", run.step.shapes)
    full = {p: len(tok_lib.encode_chat(tok, planted.SYSTEM_PROMPT, p)) for p in dict.fromkeys(src.pool)}
    cut = {p: n for p, n in full.items() if n > limit}
    assert src.truncated == cut
    for p, n in full.items():
        whole = tok_lib.encode_chat(tok, planted.SYSTEM_PROMPT, p)
        assert src.prompt_ids[p] == whole[:limit]
    logged = [r.getMessage() for r in records if "config.grpo.max_prompt_tokens" in r.getMessage()]
    assert len(logged) == len(cut)
    for p, n in cut.items():
        assert any(repr(p) in m and f" {n} tokens" in m and f"first {limit} " in m for m in logged), (p, n)
    summary = src.truncation_summary(run.grpo.steps)
    per_step = [sum(q in cut for q in planted.step_prompts(src.pool, s, options.prompts_per_step))
                for s in range(run.grpo.steps)]
    assert summary == {"prompts": len(cut), "rollouts": sum(per_step) * options.group_size,
                       "max_prompt_tokens": limit, "longest": max(cut.values(), default=0)}


@contextlib.contextmanager
def warnings_logged():
    """The WARNING log records emitted inside the block (caplog is function-scoped, and hypothesis
    runs many examples per test call)."""
    records: list = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record)

    h, root = Handler(level=logging.WARNING), logging.getLogger()
    root.addHandler(h)
    try:
        yield records
    finally:
        root.removeHandler(h)


# ------------------------------------------------------------------------------------------------
# 10. safetensors files (issue 49): truncated, empty, or a header whose offsets do not fit
# ------------------------------------------------------------------------------------------------
def _safetensors(path: pathlib.Path) -> dict:
    from safetensors.numpy import save_file

    tensors = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.float32),
               "c": np.full((2, 2), 7, np.float32)}
    save_file(tensors, str(path))
    return tensors


def _header(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def _with_header(data: bytes, header: dict) -> bytes:
    n, _ = _header(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


SAFETENSORS_DAMAGE = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 0.999)),  # the first fraction of the bytes kept (0: empty)
    st.tuples(st.just("header length"), st.integers(1, 10 ** 6)),  # the header length grown by this
    st.tuples(st.just("offsets"), st.tuples(st.sampled_from("abc"), st.integers(-8, 64), st.integers(-8, 64))),
    st.tuples(st.just("header"), st.sampled_from([b"[]", b"{", b"\xff\xfe", b'{"a": 1}',
                                                  b'{"a": {"dtype": "F32", "shape": [3, -4], "data_offsets": [0, 48]}}'])),
)


@FAST
@given(SAFETENSORS_DAMAGE)
def test_damaged_safetensors_file_is_named(damage):
    """A safetensors file cut short (an empty one included), a header length past the end, a tensor's
    data_offsets moved or resized, or a header that is not a safetensors header: a ValueError naming
    the file (it was "cannot reshape array of size 0" or a bare struct.error); the intact file reads."""
    from behaviortrace_jax.models import hf_io

    TRIED["safetensors file"] += 1
    kind, arg = damage
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "model.safetensors"
        tensors = _safetensors(path)
        data = path.read_bytes()
        f = hf_io._SafetensorsFile(path)
        for k, v in tensors.items():
            np.testing.assert_array_equal(f.tensor(k), v)
        if kind == "truncate":
            bad = data[:int(arg * len(data))]
        elif kind == "header length":
            n, _ = _header(data)
            bad = (n + arg).to_bytes(8, "little") + data[8:]
        elif kind == "offsets":
            key, da, db = arg
            _, header = _header(data)
            a, b = header[key]["data_offsets"]
            if (da, db) == (0, 0) or a + da < 0 or b + db < a + da:
                da, db = 0, 4  # a change that makes offsets inconsistent with the shape
            header[key]["data_offsets"] = [a + da, b + db]
            bad = _with_header(data, header)
        else:
            bad = len(arg).to_bytes(8, "little") + arg
        path.write_bytes(bad)
        with pytest.raises(ValueError, match=re.escape(str(path))):
            hf_io._SafetensorsFile(path)


# ------------------------------------------------------------------------------------------------
# 11. A sketch store of another hash family than the config's (issue 49)
# ------------------------------------------------------------------------------------------------
@FAST
@given(st.sampled_from(["splitmix64-block-countsketch-v1", "splitmix64-countsketch-v2", "", "block", "CountSketch"]))
def test_sketch_store_of_another_hash_family_than_the_config_is_named(other):
    """``read_complete(path, RunSpec.scores)`` (every scoring read) refuses a store whose hash_family is
    not ``sketch.hash``'s, naming the file, both families and the key; the config's own reads."""
    from behaviortrace_jax.attribution.scores import read_complete

    TRIED["hash family"] += 1
    config = tiny.get_config("smoke")
    config.sketch.dim, config.sketch.seed, config.seed, config.sketch.hash = 256, 0, 0, "splitmix64"
    options = RunSpec.from_config(config).scores
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "s.zarr"
        _store(path, hash_family=other)
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}/metadata\.json: the store's hash_family is "
                                             rf"'{re.escape(other)}'.*config sketch\.hash"):
            read_complete(path, options)
        path2 = pathlib.Path(tmp) / "t.zarr"
        _store(path2)
        assert read_complete(path2, options).metadata["hash_family"] == "splitmix64-countsketch-v3"
