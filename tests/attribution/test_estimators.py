"""Estimators (SPEC §4, §9 test_cross_step / test_gradient_baselines / test_local_buffer)."""
from __future__ import annotations

import numpy as np
import pytest

from behaviortrace_jax.attribution import estimators, tables, verdicts


# ---- C1 --------------------------------------------------------------------------------------
def test_c1_dot_and_cosine():
    v = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0], [-3.0, 0.0]], np.float32)
    t = np.array([2.0, 0.0], np.float32)
    np.testing.assert_allclose(estimators.c1_dot(v, t), [2.0, 0.0, 0.0, -6.0])
    np.testing.assert_allclose(estimators.c1_cosine(v, t), [1.0, 0.0, 0.0, -1.0])  # zero row -> 0


@pytest.mark.parametrize("fn", [estimators.c1_dot, estimators.c1_cosine])
def test_c1_errors(fn):
    v = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="1-D"):
        fn(v, np.ones((4, 1)))
    with pytest.raises(ValueError, match="shape mismatch"):
        fn(v, np.ones(5))
    with pytest.raises(ValueError, match="2-D"):
        fn(np.ones(4), np.ones(4))


def test_cosine_zero_target_raises():
    with pytest.raises(ValueError, match="zero norm"):
        estimators.c1_cosine(np.ones((2, 3)), np.zeros(3))


# ---- TRAK ------------------------------------------------------------------------------------
def _explicit_trak(phi, t, damping):
    phi, t = phi.astype(np.float64), t.astype(np.float64)
    lam = damping * np.sum(phi**2) / phi.shape[1]
    return phi @ np.linalg.inv(phi.T @ phi + lam * np.eye(phi.shape[1])) @ t, \
        np.linalg.inv(phi @ phi.T + lam * np.eye(phi.shape[0])) @ (phi @ t)


def test_trak_dual_equals_primal():
    rng = np.random.default_rng(0)
    phi, t = rng.normal(size=(12, 200)), rng.normal(size=200)  # d = 200 > R = 12: dual path
    primal, dual = _explicit_trak(phi, t, 0.1)
    np.testing.assert_allclose(estimators.trak(phi, t, damping=0.1), primal, atol=1e-7)
    np.testing.assert_allclose(primal, dual, atol=1e-7)
    phi2, t2 = rng.normal(size=(12, 5)), rng.normal(size=5)  # d = 5 <= R = 12: primal path
    primal2, dual2 = _explicit_trak(phi2, t2, 0.1)
    np.testing.assert_allclose(estimators.trak(phi2, t2, damping=0.1), dual2, atol=1e-7)


def test_trak_whitening_changes_ranking_and_weights_scale():
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(40, 6)) * np.array([30.0, 1, 1, 1, 1, 1])  # anisotropic cloud
    t = np.ones(6)
    raw, white = phi @ t, estimators.trak(phi, t, damping=0.05)
    assert not np.array_equal(np.argsort(-raw), np.argsort(-white))
    w = np.linspace(0.5, 2.0, 40)
    np.testing.assert_allclose(estimators.trak(phi, t, damping=0.05, weights=w), white * w)
    with pytest.raises(ValueError, match="damping must be > 0"):
        estimators.trak(phi, t, damping=0.0)
    with pytest.raises(ValueError, match="1-D"):
        estimators.trak(phi, np.ones((6, 1)))
    with pytest.raises(ValueError, match="weights"):
        estimators.trak(phi, t, weights=np.ones(3))
    assert estimators.trak(np.zeros((0, 6)), t).shape == (0,)
    np.testing.assert_allclose(estimators.trak(np.zeros((3, 6)), t), 0.0)  # λ = 0 -> raw dot


# ---- TracInCP --------------------------------------------------------------------------------
def test_tracin_governing_checkpoint_and_lr():
    t100, t200 = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    v = np.array([[2.0, 7.0], [2.0, 7.0], [2.0, 7.0]])
    steps = np.array([150, 250, 50])
    s = estimators.tracin_cp(v, steps, {100: t100, 200: t200}, lr={100: 3.0})
    # 150 -> ckpt 100, lr 3: 3·2 = 6.0; 250 -> ckpt 200, lr defaults to 1.0: 7; 50 -> earliest (100).
    np.testing.assert_allclose(s, [6.0, 7.0, 6.0])
    assert estimators.governing_checkpoint(99, [100, 200]) == 100
    assert estimators.governing_checkpoint(200, [100, 200]) == 200
    np.testing.assert_allclose(estimators.tracin_cp(v, steps, {100: t100}, lr=0.5), [1.0, 1.0, 1.0])


def test_tracin_single_checkpoint_equals_c1_dot():
    rng = np.random.default_rng(1)
    v, t = rng.normal(size=(20, 8)).astype(np.float32), rng.normal(size=8).astype(np.float32)
    np.testing.assert_allclose(estimators.tracin_cp(v, np.arange(20), {1000: t}, lr=1.0), estimators.c1_dot(v, t), rtol=1e-5)


def test_tracin_errors():
    with pytest.raises(ValueError, match="at least one entry"):
        estimators.tracin_cp(np.ones((2, 3)), [0, 1], {})
    with pytest.raises(ValueError, match="shape mismatch"):
        estimators.tracin_cp(np.ones((2, 3)), [0, 1], {0: np.ones(4)})
    with pytest.raises(ValueError, match="1-D"):
        estimators.tracin_cp(np.ones((2, 3)), [0, 1], {0: np.ones((3, 1))})


# ---- norm-only, local buffer, random -------------------------------------------------------
def test_norm_only():
    np.testing.assert_allclose(estimators.norm_only(np.array([[3.0, 4.0], [0.0, 0.0]])), [5.0, 0.0])


def test_local_buffer_selection_and_scores():
    np.testing.assert_array_equal(estimators.local_buffer_steps(np.arange(20), 15, 5), [14, 13, 12, 11, 10])
    with pytest.raises(ValueError, match="window must be positive"):
        estimators.local_buffer_steps(np.arange(20), 15, 0)
    rng = np.random.default_rng(0)
    v, t = rng.normal(size=(20, 4)), rng.normal(size=4)
    s = estimators.local_buffer(v, np.arange(20), t, current_step=15, window=5)
    assert np.isneginf(s[:10]).all() and np.isneginf(s[15:]).all()
    np.testing.assert_allclose(s[10:15], estimators.cosine(v[10:15], t))
    # notebook defaults: current = max step + 1 = 20, window = 2 -> steps 18, 19
    assert np.isfinite(estimators.local_buffer(v, np.arange(20), t)).nonzero()[0].tolist() == [18, 19]


def test_local_buffer_metrics():
    t = np.array([1.0, 0.0])
    v = np.array([[10.0, 0.0], [1.0, 0.0], [-1.0, 0.0]])
    cos = estimators.local_buffer(v, [0, 1, 2], t, current_step=3, window=3)
    np.testing.assert_allclose(cos, [1.0, 1.0, -1.0], atol=1e-6)  # magnitudes equalised
    np.testing.assert_allclose(estimators.local_buffer(v, [0, 1, 2], t, current_step=3, window=3, metric="dot"), [10, 1, -1])
    np.testing.assert_allclose(estimators.local_buffer(v, [0, 1, 2], np.zeros(2), current_step=3, window=3, metric="dot"), 0.0)
    with pytest.raises(ValueError, match="zero norm"):
        estimators.local_buffer(v, [0, 1, 2], np.zeros(2), current_step=3, window=3)
    with pytest.raises(ValueError, match="shape mismatch"):
        estimators.local_buffer(v, [0, 1, 2], np.ones(3), current_step=3, window=3)


def test_local_buffer_finds_planted_vector():
    rng = np.random.default_rng(0)
    t = rng.normal(size=64)
    v = rng.normal(size=(51, 64))
    v[17] = t + 0.1 * rng.normal(size=64)
    s = estimators.local_buffer(v, np.arange(51), t, current_step=51, window=51)
    assert int(np.argmax(s)) == 17


def test_random_scores_are_the_numpy_shuffle():
    ids = [f"r{i}" for i in range(50)]
    s = estimators.random_scores(ids, 3)
    assert sorted(s.tolist()) == [-float(i) for i in range(49, -1, -1)]
    shuffled = list(ids)
    np.random.default_rng(3).shuffle(shuffled)
    assert [ids[i] for i in np.argsort(-s)] == shuffled
    assert np.array_equal(estimators.random_scores(ids, 3), s) and not np.array_equal(estimators.random_scores(ids, 4), s)


# ---- rollout level --------------------------------------------------------------------------
def test_rollout_level_estimators():
    rng = np.random.default_rng(2)
    g = rng.normal(size=(8, 5))
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    t = rng.normal(size=5)
    cos = lambda a, b: a @ b / ((np.linalg.norm(a) + 1e-12) * (np.linalg.norm(b) + 1e-12))  # noqa: E731
    np.testing.assert_allclose(estimators.c1_plain(g, t), [cos(x, t) for x in g])
    centred = np.concatenate([g[:4] - g[:4].mean(0), g[4:] - g[4:].mean(0)])
    np.testing.assert_allclose(estimators.gas_centered(g, groups, t), [cos(x, t) for x in centred])
    np.testing.assert_allclose(estimators.rollout_norm(g), np.linalg.norm(g, axis=1))
    lp = np.array([[-1.0, -3.0, -9.0], [-2.0, -9.0, -9.0]])
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    np.testing.assert_allclose(estimators.mean_token_logprob(lp, mask), [-2.0, -2.0])
    with pytest.raises(ValueError, match="no response tokens"):
        estimators.mean_token_logprob(lp, np.zeros_like(mask))


def test_score_rollout_rows_layout():
    rng = np.random.default_rng(3)
    g = rng.normal(size=(8, 5)).astype(np.float32)
    groups = np.repeat([0, 1], 4)
    has = np.array([1, 0, 1, 1, 0, 1, 0, 0], bool)
    t, tb = rng.normal(size=5), rng.normal(size=5)
    rows = estimators.score_rollout_rows(g, groups, has, {"mp": t, "mp_bal": tb}, fluency=np.linspace(-2, -1, 8))
    assert list(rows[0]) == ["group", "has_qzxbt", "fluency", "norm", "mp", "mp_centered", "mp_bal_centered"]
    assert rows[5]["has_qzxbt"] is True and rows[5]["group"] == 1
    np.testing.assert_allclose([r["mp_bal_centered"] for r in rows], estimators.gas_centered(g, groups, tb))
    with pytest.raises(ValueError, match="mp_bal"):
        estimators.score_rollout_rows(g, groups, has, {"mp": t}, fluency=np.zeros(8))
    with pytest.raises(ValueError, match="fluency"):
        estimators.score_rollout_rows(g, groups, has, {"mp": t, "mp_bal": tb})


# ---- cross-step aggregation (SPEC §9 test_cross_step) ---------------------------------------
def test_cross_step_sums_appearances():
    t = np.array([1.0, 0.0])
    ids = ["a", "a", "a", "b"]
    v = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [2.5, 0.0]])
    out = estimators.cross_step_scores(ids, [1, 5, 9, 3], v, t)
    assert [r[0] for r in out] == ["a", "b"] and out[0][1] == pytest.approx(3.0) and out[0][2] == 9
    windowed = estimators.cross_step_scores(ids, [1, 5, 9, 3], v, t, step_range=(0, 6))
    assert windowed[0] == ("b", 2.5, 3) and windowed[1] == ("a", pytest.approx(2.0), 5)
    cos = estimators.cross_step_scores(["x", "y", "z"], [0, 0, 0], np.array([[5.0, 0.0], [1.0, 0.0], [-1.0, 0.0]]), t,
                              metric="cosine")
    assert cos[0][1] == pytest.approx(cos[1][1]) and cos[-1][0] == "z"
    assert estimators.cross_step_scores([], [], np.zeros((0, 2)), t) == []


def test_cross_step_errors():
    t = np.ones(2)
    with pytest.raises(ValueError, match="1-D"):
        estimators.cross_step_scores(["a"], [0], np.ones((1, 2)), np.ones((2, 1)))
    with pytest.raises(ValueError, match="unknown metric"):
        estimators.cross_step_scores(["a"], [0], np.ones((1, 2)), t, metric="l2")
    with pytest.raises(ValueError, match="zero norm"):
        estimators.cross_step_scores(["a"], [0], np.ones((1, 2)), np.zeros(2), metric="cosine")
    with pytest.raises(ValueError, match="shape mismatch"):
        estimators.cross_step_scores(["a"], [0], np.ones((1, 3)), t)
    with pytest.raises(ValueError, match="lo > hi"):
        estimators.cross_step_scores(["a"], [0], np.ones((1, 2)), t, step_range=(5, 1))


# ---- runners and plug-ins -------------------------------------------------------------------
def test_expand_to_rollouts():
    s = estimators.expand_to_rollouts([1.5, 2.5], [0, 2], [0, 0, 1, 2])
    assert s[0] == s[1] == 1.5 and np.isneginf(s[2]) and s[3] == 2.5
    with pytest.raises(ValueError, match="unique"):
        estimators.expand_to_rollouts([1.0, 2.0], [0, 0], [0])


def test_score_step_methods_runs_every_estimator_with_its_inputs():
    rng = np.random.default_rng(4)
    v, t = rng.normal(size=(3, 6)).astype(np.float32), rng.normal(size=6).astype(np.float32)
    ids = [f"grpo_{s:06d}_{i:03d}" for s in range(3) for i in range(2)]
    rsteps = np.repeat(np.arange(3), 2)
    out = estimators.score_step_methods(v, np.arange(3), ids, rsteps, target=t, seed=0, window=1)
    assert list(out) == ["C1-dot", "C1-cosine", "TRAK", "norm-only", "local-buffer", "random"]  # no TracInCP map
    np.testing.assert_allclose(out["C1-dot"], np.repeat(estimators.c1_dot(v, t), 2))
    assert np.isneginf(out["local-buffer"][:4]).all() and np.isfinite(out["local-buffer"][4:]).all()
    out = estimators.score_step_methods(v, np.arange(3), ids, rsteps, target=t, names=["TracInCP"],
                               targets_by_checkpoint={0: t}, lr=1.0)
    np.testing.assert_allclose(out["TracInCP"], np.repeat(estimators.c1_dot(v, t), 2), rtol=1e-6)
    per = estimators.score_step_methods(rng.normal(size=(6, 6)), rsteps, ids, rsteps, target=t,
                               per_rollout_sketches=True, names=["C1-dot"])
    assert per["C1-dot"].shape == (6,) and len(set(per["C1-dot"].tolist())) == 6
    with pytest.raises(ValueError, match="needs input"):
        estimators.score_step_methods(v, np.arange(3), ids, rsteps, target=t, names=["TracInCP"])


@pytest.fixture
def plugin():
    @estimators.register_estimator("test-abs-dot", level="step")
    def abs_dot(sketches, target):
        """|v_s·t|."""
        return np.abs(np.asarray(sketches) @ np.asarray(target))

    yield "test-abs-dot"
    del estimators.ESTIMATORS["test-abs-dot"]


def test_plugin_estimator_gets_tables_and_verdicts(plugin):
    with pytest.raises(ValueError, match="already registered"):
        estimators.register_estimator(plugin, level="step")(lambda sketches: sketches)
    rng = np.random.default_rng(5)
    steps = np.arange(8)
    v = rng.normal(size=(8, 4))
    t = rng.normal(size=4)
    ids = [f"grpo_{s:06d}_{i:03d}" for s in steps for i in range(4)]
    rsteps = np.repeat(steps, 4)
    scores = estimators.score_step_methods(v, steps, ids, rsteps, target=t, seed=0)
    assert plugin in scores
    gt = [ids[i] for i in range(0, 32, 3)]
    rows = tables.step_level_tables(0, ids, rsteps, gt, scores, nonzero_steps=steps, early_cutoff=6)
    assert {(r.table, r.method) for r in rows} >= {("overall", plugin), ("early_nonzero", plugin)}
    rule = next(v for v in verdicts.decision_rules(rows) if v.item.startswith("step rule"))
    assert rule.status in ("pass", "fail")
    best = max((r for r in rows if r.table == "early_nonzero" and estimators.ESTIMATORS[r.method].role == "primary"),
               key=lambda r: r.value)
    assert best.method in rule.evidence


# ---- reward-only controls and the two sketch kinds -------------------------------------------
def test_reward_only_controls_read_the_training_log():
    adv = np.array([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    rew = np.array([8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    steps = np.repeat([0, 1], 4)
    np.testing.assert_array_equal(estimators.call_estimator("advantage", advantages=adv), adv)
    np.testing.assert_array_equal(estimators.call_estimator("abs-advantage", advantages=adv), np.abs(adv))
    np.testing.assert_array_equal(estimators.call_estimator("reward", rewards=rew), rew)
    np.testing.assert_array_equal(estimators.call_estimator("step-sum-abs-advantage", advantages=adv,
                                                            rollout_steps=steps), [3.0] * 4 + [0.0] * 4)
    np.testing.assert_allclose(estimators.call_estimator("step-reward-std", rewards=rew, rollout_steps=steps),
                               [np.std([8, 0, 0, 0])] * 4 + [0.0] * 4)
    sk = np.array([[3.0, 4.0]] * 8)
    np.testing.assert_allclose(estimators.call_estimator("norm/|A|", rollout_sketches=sk, advantages=adv),
                               [5 / 1.5, 10, 10, 10, 0, 0, 0, 0])  # 0 where A = 0
    with pytest.raises(ValueError, match="non-finite"):
        estimators.call_estimator("reward", rewards=np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="steps must have shape"):
        estimators.call_estimator("step-reward-std", rewards=rew, rollout_steps=steps[:3])
    assert estimators.reward_only("abs-advantage") and not estimators.reward_only("norm/|A|")
    assert not estimators.reward_only("C1-dot") and not estimators.reward_only("random")


def test_reward_only_controls_join_every_table_only_with_their_inputs():
    rng = np.random.default_rng(6)
    ids = [f"grpo_{s:06d}_{i:03d}" for s in range(3) for i in range(4)]
    rsteps = np.repeat(np.arange(3), 4)
    v, t = rng.normal(size=(3, 5)), rng.normal(size=5)
    log = dict(advantages=rng.normal(size=12), rewards=rng.normal(size=12))
    step = estimators.score_step_methods(v, np.arange(3), ids, rsteps, target=t, seed=0, **log)
    assert set(estimators.REWARD_ONLY_ROLLOUT_CONTROLS + estimators.REWARD_ONLY_STEP_CONTROLS) <= set(step)
    assert "norm/|A|" not in step  # needs per-rollout sketches
    assert "advantage" not in estimators.score_step_methods(v, np.arange(3), ids, rsteps, target=t, seed=0)
    w, d = rng.normal(size=(12, 5)), rng.normal(size=(12, 5))
    both = estimators.score_rollout_sketches(w, d, ids, rsteps, target=t, seed=0, **log)
    assert "norm/|A|" in both and "C1-dot:direction" in both and "norm-only:direction" in both
    assert "random:direction" not in both and "advantage:direction" not in both  # read no sketches
    np.testing.assert_allclose(both["C1-dot:direction"], d @ t)
    np.testing.assert_allclose(both["C1-dot"], w @ t)
    assert not any(estimators.is_direction(m) for m in estimators.score_rollout_sketches(w, None, ids, rsteps,
                                                                                         target=t, seed=0))
    assert estimators.base_method("TRAK:direction") == "TRAK" and estimators.base_method("TRAK") == "TRAK"
