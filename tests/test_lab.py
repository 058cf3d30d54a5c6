"""The credit lab: exact values, sampling, scoring, training and the ``lab`` command."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import cli
from jaxrl_agent.lab import arms, learning, mdp as M, sampling, scoring, tasks


def tiny_mdp():
    """s0 -a0-> s1 (no reward); s0 -a1-> T_a (arrival 0.3).
    s1 -a0-> T_b (arrival 1) with prob 0.8, T_c (arrival 0) with prob 0.2; s1 -a1-> T_c.
    States: 0 = s0, 1 = s1, 2 = T_a, 3 = T_b, 4 = T_c. Horizon 2."""
    S, A = 5, 2
    P = np.zeros((S, A, S))
    P[0, 0, 1] = 1.0
    P[0, 1, 2] = 1.0
    P[1, 0, 3], P[1, 0, 4] = 0.8, 0.2
    P[1, 1, 4] = 1.0
    for t in (2, 3, 4):
        P[t, :, t] = 1.0
    arrival = np.array([0, 0, 0.3, 1.0, 0])
    terminal = np.array([False, False, True, True, True])
    start = np.array([1.0, 0, 0, 0, 0])
    return M.make_mdp(P, np.zeros((S, A)), terminal, start, 2, arrival=arrival)


def test_exact_values_by_hand():
    mdp = tiny_mdp()
    logits = jnp.log(jnp.array([[0.25, 0.75], [0.6, 0.4], [0.5, 0.5], [0.5, 0.5],
                                [0.5, 0.5]]))
    v, q = M.exact_values(mdp, logits)
    # turn 1 in s1: Q = (0.8, 0), V = 0.6 * 0.8 = 0.48
    np.testing.assert_allclose(q[1, 1], [0.8, 0.0], atol=1e-6)
    np.testing.assert_allclose(v[1, 1], 0.48, atol=1e-6)
    # turn 0 in s0: Q = (V_1(s1), 0.3) = (0.48, 0.3); V = 0.25 * 0.48 + 0.75 * 0.3
    np.testing.assert_allclose(q[0, 0], [0.48, 0.3], atol=1e-6)
    np.testing.assert_allclose(v[0, 0], 0.12 + 0.225, atol=1e-6)
    adv = M.exact_advantages(mdp, logits)
    np.testing.assert_allclose(adv[0, 0], [0.48 - 0.345, 0.3 - 0.345], atol=1e-6)
    # terminal states have value 0; the horizon truncates: with H = 1 s1 is never acted in
    assert float(jnp.abs(v[:, 2:]).max()) == 0.0
    short = mdp.replace(horizon=1)
    np.testing.assert_allclose(M.expected_return(short, logits), 0.75 * 0.3, atol=1e-6)
    np.testing.assert_allclose(M.optimal_return(mdp), 0.8, atol=1e-6)


def test_make_mdp_rejects_bad_input():
    mdp = tiny_mdp()
    with pytest.raises(ValueError, match="P\\[s, a, :\\]"):
        M.make_mdp(np.asarray(mdp.P) * 0.5, mdp.R, mdp.terminal, mdp.start, 2)
    with pytest.raises(ValueError, match="start puts mass on a terminal"):
        M.make_mdp(mdp.P, mdp.R, mdp.terminal, np.array([0, 0, 1.0, 0, 0]), 2)


def test_chain_success_is_the_product_of_correct_steps():
    task = tasks.make_task("distractor", length=3, distractors=2, exposed=2, seed=3)
    mdp = task.mdp
    logits = jax.random.normal(jax.random.PRNGKey(1), (mdp.num_obs, mdp.num_actions))
    assert mdp.num_obs == mdp.horizon + 1  # the agent sees the step, not the broken flag
    pi = np.asarray(M.policy_probs(mdp, logits))
    P = np.asarray(mdp.P)
    prob = 1.0
    for i in range(mdp.horizon):  # along the intact chain: state 2 i
        stay = P[2 * i, :, 2 * (i + 1)]  # 1 for the actions that keep the chain intact
        prob *= float(pi[2 * i] @ stay)
    np.testing.assert_allclose(M.expected_return(mdp, logits), prob, rtol=1e-5)
    assert task.info["v_d"] == pytest.approx(2 / 3, abs=1e-4)
    adv = np.asarray(M.exact_advantages(mdp, logits))
    for i in task.info["distractor_turns"]:  # redundant turns: every action is as good
        np.testing.assert_allclose(adv[i, 2 * i], 0.0, atol=1e-6)


def test_sampling_matches_the_exact_values_and_packs_a_valid_batch():
    mdp = tiny_mdp()
    logits = jnp.zeros((5, 2))
    batch, roll = jax.jit(sampling.sample_batch, static_argnums=(3, 4))(
        jax.random.PRNGKey(0), mdp, logits, 64, 32)
    batch.validate()
    # E[outcome] = J = 0.5 * 0.5 * 0.8 + 0.5 * 0.3 = 0.35; 2048 rollouts: std ~ 0.01
    assert abs(float(batch.outcome.mean()) - 0.35) < 0.04
    m = np.asarray(batch.turn_mask)
    ends = np.asarray(roll["action"])[:, 0] == 1  # a1 at s0 ends the rollout at once
    assert (m[:, 0]).all() and not m[ends, 1].any() and m[~ends, 1].all()
    np.testing.assert_array_equal(np.asarray(batch.state_keys)[~ends, 1], 1)
    assert np.asarray(batch.group_ids)[:64].tolist() == [0] * 32 + [32] * 32
    # exact_adv is A_k(s_k, a_k) of the sampling policy
    adv = np.asarray(M.exact_advantages(mdp, logits))
    np.testing.assert_allclose(np.asarray(batch.extras["exact_adv"])[:, 0],
                               adv[0, 0, np.asarray(roll["action"])[:, 0]], atol=1e-6)


def retry_mdp():
    """s0 -a0-> s0 (wait); s0 -a1-> goal s1 (arrival 1) or s0, with prob 1/2 each. Horizon 3:
    the values depend on the turn (fewer turns left, less chance to reach the goal)."""
    P = np.zeros((2, 2, 2))
    P[0, 0, 0] = 1.0
    P[0, 1, 1] = P[0, 1, 0] = 0.5
    P[1, :, 1] = 1.0
    return M.make_mdp(P, np.zeros((2, 2)), [False, True], [1.0, 0.0], 3, arrival=[0.0, 1.0])


def test_extras_use_the_values_of_each_turn():
    """exact_adv and turn_values at turn k are A_k, V_k (not turn 0's) on every valid turn:
    the retry MDP's values differ by turn, so a wrong time index fails here."""
    mdp = retry_mdp()
    logits = jnp.zeros((2, 2))
    v, _ = M.exact_values(mdp, logits)
    # uniform policy, by hand: Q_2 = (0, 1/2), V_2 = 1/4; Q_1 = (1/4, 1/2 + 1/8), V_1 = 7/16;
    # Q_0 = (7/16, 1/2 + 7/32), V_0 = 37/64
    np.testing.assert_allclose(v[:, 0], [37 / 64, 0.4375, 0.25, 0.0], atol=1e-6)
    adv = np.asarray(M.exact_advantages(mdp, logits))
    np.testing.assert_allclose(adv[2, 0], [-0.25, 0.25], atol=1e-6)
    np.testing.assert_allclose(adv[1, 0], [-0.1875, 0.1875], atol=1e-6)
    batch, roll = sampling.sample_batch(jax.random.PRNGKey(1), mdp, logits, 8, 8)
    s, a, m = (np.asarray(roll[x]) for x in ("state", "action", "mask"))
    assert m[:, 2].sum() > 10  # many rollouts reach the last turn
    k = np.broadcast_to(np.arange(3), s.shape)
    np.testing.assert_allclose(np.asarray(batch.extras["exact_adv"])[m], adv[k, s, a][m],
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.extras["turn_values"])[m],
                               np.asarray(v)[k, s][m], atol=1e-6)


def test_spearman_averages_tied_ranks():
    from scipy.stats import spearmanr
    c, a = np.array([[1.0, 2.0, 2.0, 3.0]]), np.array([[1.0, 2.0, 3.0, 4.0]])
    # ranks of c: 1, 2.5, 2.5, 4; corr with 1..4: 4.5 / sqrt(4.5 * 5)
    got = scoring.turn_metrics(c, a, np.ones_like(c, bool))["spearman"]
    assert got == pytest.approx(4.5 / np.sqrt(22.5))
    rng = np.random.default_rng(1)
    c, a = rng.integers(0, 4, (5, 6)).astype(float), rng.normal(size=(5, 6))
    mask = rng.random((5, 6)) < 0.8
    got = scoring.turn_metrics(c, a, mask)["spearman"]
    assert got == pytest.approx(spearmanr(c[mask], a[mask]).statistic)


def test_sign_metric_skips_tiny_advantages_and_counts_zero_credit_as_wrong():
    c = np.array([[1.0, -1.0, 0.0, 5.0, 2.0]])
    a = np.array([[2.0, 3.0, -1.0, 1e-8, -4.0]])  # |A| = 1e-8 <= eps: not counted
    assert scoring.turn_metrics(c, a, np.ones_like(c, bool))["sign"] == pytest.approx(1 / 4)
    assert scoring.turn_metrics(c, 0 * a, np.ones_like(c, bool))["sign"] == 0.0


def test_summarize_and_paired_difference_t_intervals():
    rng = np.random.default_rng(2)
    curves = rng.random((16, 5))
    out = learning.summarize(curves)
    final = curves[:, -1]
    sd = np.sqrt(np.sum((final - final.mean()) ** 2) / 15)
    assert out["final"]["mean"] == pytest.approx(final.mean())
    assert out["final"]["std"] == pytest.approx(sd)
    assert out["final"]["ci"] == pytest.approx(2.131 * sd / 4, rel=1e-3)  # t_{0.975, 15}
    assert out["auc"]["mean"] == pytest.approx(curves.mean())
    np.testing.assert_allclose(out["ci"], 2.1314 * curves.std(0, ddof=1) / 4, rtol=1e-4)
    a, b = np.array([0.5, 0.7, 0.2, 0.9]), np.array([0.4, 0.7, 0.3, 0.6])
    d = a - b  # 0.1, 0, -0.1, 0.3: a ahead on 2 seeds (a tie is not a win)
    diff = learning.paired_difference(a, b)
    assert diff["mean"] == pytest.approx(0.075) and diff["wins"] == 2 and diff["seeds"] == 4
    assert diff["ci"] == pytest.approx(3.182 * d.std(ddof=1) / 2, rel=1e-3)  # t_{0.975, 3}


def test_turn_metrics_on_known_credit():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(6, 4))
    mask = np.ones((6, 4), bool)
    mask[0, 2:] = False
    perfect = scoring.turn_metrics(3.0 * a, a, mask)
    assert perfect["pearson"] == pytest.approx(1.0) and perfect["spearman"] == pytest.approx(1.0)
    assert perfect["sign"] == 1.0 and perfect["nmse"] == pytest.approx(0.0, abs=1e-12)
    flipped = scoring.turn_metrics(-a, a, mask)
    assert flipped["pearson"] == pytest.approx(-1.0) and flipped["sign"] == 0.0
    assert flipped["nmse"] == pytest.approx(1.0)
    zero = scoring.turn_metrics(np.zeros_like(a), a, mask)
    assert zero["pearson"] == 0.0 and zero["nmse"] == pytest.approx(1.0) and zero["degenerate"]
    assert not perfect["degenerate"] and scoring.turn_metrics(a, 0 * a, mask)["degenerate"]
    # padding is ignored: garbage off the mask changes nothing
    junk = np.where(mask, a, 1e6)
    assert scoring.turn_metrics(junk, a, mask)["pearson"] == pytest.approx(1.0)


def test_unbiased_estimator_approaches_perfect_as_group_size_grows():
    """Return-to-go minus the exact V is unbiased for A: its per-cell mean converges to A as
    the batch grows; the exact arm is perfect at any size."""
    task = tasks.make_task("tree", depth=3, width=3, num_actions=2, slip=0.3)
    arm = arms.parse_arm("mc_minus_v")
    small = scoring.score_arm(task, arm, seeds=3, num_groups=3, group_size=4)
    large = scoring.score_arm(task, arm, seeds=3, num_groups=3, group_size=256)
    assert large["cell_pearson"][0] > 0.97
    assert large["cell_pearson"][0] > small["cell_pearson"][0] + 0.05
    # single rollouts stay noisy: the per-turn correlation is capped well below 1
    assert large["pearson"][0] < 0.9
    exact = scoring.score_arm(task, arms.parse_arm("exact"), seeds=2, num_groups=3,
                              group_size=4)
    assert exact["pearson"][0] == pytest.approx(1.0) and exact["sign"][0] == 1.0


def test_scoring_and_training_are_deterministic_for_a_seed():
    task = tasks.make_task("chain", length=3, exposed=1)
    arm = arms.parse_arm("grpo")
    a = scoring.score_arm(task, arm, seeds=2, num_groups=2, group_size=4, seed=5)
    b = scoring.score_arm(task, arm, seeds=2, num_groups=2, group_size=4, seed=5)
    assert a == b
    logits = scoring.scoring_policy(task)
    keys = [jax.random.split(jax.random.PRNGKey(s), 2) for s in (5, 5, 6)]
    runs = [scoring.sampled_credit(task, arm, logits, k, 2, 4) for k in keys]
    for x, y in zip(runs[0], runs[1]):  # credit, exact, mask, state, action
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(runs[0][4], runs[2][4])  # another seed, other rollouts
    kw = dict(seeds=2, steps=5, num_groups=2, group_size=4, seed=1)
    one = learning.train_curves(task.mdp, arm, **kw)
    np.testing.assert_array_equal(one, learning.train_curves(task.mdp, arm, **kw))
    assert one.shape == (2, 6) and np.all((one >= 0) & (one <= 1))
    np.testing.assert_allclose(one[:, 0], float(M.expected_return(
        task.mdp, task.mdp.zero_logits())), rtol=1e-6)


def test_training_with_exact_credit_learns_the_chain():
    task = tasks.make_task("chain", length=3, exposed=1)
    curves = learning.train_curves(task.mdp, arms.parse_arm("exact"), seeds=2, steps=30,
                                   num_groups=2, group_size=4)
    assert curves[:, -1].min() > 0.5 > curves[:, 0].max()


def test_arm_specs():
    uni = arms.parse_arm("uniform")
    assert uni.pipeline.names == ("uniform", "step_group")
    comp = arms.parse_arm("uniform:grpo+reallocate")
    assert comp.pipeline.names == ("uniform", "grpo", "reallocate")
    with pytest.raises(ValueError, match="(?s)unknown estimator 'nope'.*named arms: sparse"):
        arms.parse_arm("nope")
    with pytest.raises(ValueError, match="stateful"):
        arms.parse_arm("spo")
    with pytest.raises(ValueError, match="given twice"):
        arms.parse_arms("grpo,grpo")
    with pytest.raises(ValueError, match="unknown task 'maze'; known: tree"):
        tasks.make_task("maze")
    with pytest.raises(ValueError, match="no parameter"):
        tasks.make_task("chain", depth=3)


def test_shuffled_weights_keep_each_rollouts_multiset():
    w = jnp.array([[1.0, 0.0, 0.0, 2.0], [0.0, 5.0, 0.0, 0.0]])
    mask = jnp.array([[True, True, True, False], [True, True, True, True]])
    out = np.asarray(sampling.shuffle_within_rows(jax.random.PRNGKey(3), w, mask))
    assert sorted(out[0, :3]) == [0.0, 0.0, 1.0] and out[0, 3] == 0.0
    assert sorted(out[1]) == [0.0, 0.0, 0.0, 5.0]


def test_cli_lab(tmp_path, capsys):
    rc = cli.main(["lab", "--estimators", "grpo,nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown estimator 'nope'" in err
    assert err.count("bipace") == 1  # the estimator list is printed once
    assert cli.main(["lab", "--task-set", "depth=x", "--task", "chain"]) == 2
    # the settings of the determinism test above: the compiled functions are reused
    rc = cli.main(["lab", "--task", "chain", "--task-set", "length=3", "--estimators",
                   "grpo", "--seeds", "2", "--steps", "5", "--group-sizes", "4",
                   "--num-groups", "2", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "cell_pearson" in out and "+-95% CI" in out and "degen" in out
    data = json.loads((tmp_path / "lab_chain.json").read_text())
    assert set(data["arms"]) == {"grpo"} and data["task"]["length"] == 3
    assert set(data["arms"]["grpo"]["scores"][0]) >= set(scoring.METRICS)
    assert len(data["arms"]["grpo"]["learning"]["mean"]) == 6
    for name in ("lab_chain_correlation.png", "lab_chain_learning.png"):
        assert (tmp_path / name).stat().st_size > 1000


def test_chains_differing_in_v_d_differ_only_in_the_checks():
    one, three = (tasks.make_task("chain", length=4, exposed=k) for k in (1, 3))
    np.testing.assert_array_equal(one.mdp.P, three.mdp.P)
    assert set(one.info["checked_turns"]) < set(three.info["checked_turns"])
    assert one.info["v_d"] == 0.25 and three.info["v_d"] == 0.75
    assert float(jnp.sum(one.mdp.check)) < float(jnp.sum(three.mdp.check))
