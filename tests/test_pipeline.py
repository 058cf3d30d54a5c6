"""Credit pipelines: the three registry kinds, ``Pipeline`` (shaping -> estimator -> transforms),
its use from ``compute``, the CLI (``--shaping``/``--then``/``--set stage.key=v``), configs
(``estimator.shaping``/``estimator.then``) and the train step; the record fields that carry
their signals (``traj_extras``, ``edges``)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_agent import cli
from jaxrl_agent import config as C
from jaxrl_agent import run_checks
from jaxrl_agent import estimators as E
from jaxrl_agent.rollout.records import RecordError, pack_records
from tests.strategies import PAD


def _records(seed=0, n=8, weights=True):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            t = {"observation": [int(x) for x in rng.integers(0, 50, 2)],
                 "action": [int(x) for x in rng.integers(0, 50, int(rng.integers(1, 4)))],
                 "reward": float(np.round(rng.normal(), 2))}
            if weights:
                t["turn_extras"] = {"w": float(np.round(rng.random(), 3))}
            turns.append(t)
        recs.append({"group": i // 3, "outcome": float(rng.integers(0, 2)), "turns": turns})
    return recs


def _batch(layout="concatenated", **kw):
    return pack_records(_records(**kw), layout=layout, pad_to=PAD[layout])[0]


# ----------------------------------------------------------------------------- registry


def test_kinds_are_listed_apart():
    assert "grpo" in E.names() and "reallocate" not in E.names()
    assert "reallocate" in E.names("transform") and "grpo" not in E.names("transform")
    every = E.names("all")
    assert set(every) == set(E.names()) | set(E.names("shaping")) | set(E.names("transform"))
    with pytest.raises(ValueError, match="kind"):
        E.names("losses")


def test_spec_refuses_the_wrong_kind():
    with pytest.raises(ValueError, match="'reallocate' is a transform, not an estimator"):
        E.spec("reallocate", "estimator")
    with pytest.raises(ValueError, match="'grpo' is an estimator, not a transform"):
        E.spec("grpo", "transform")
    with pytest.raises(ValueError, match="unknown transform 'realocate'.*reallocate"):
        E.spec("realocate", "transform")
    with pytest.raises(ValueError, match="is a transform, not an estimator"):
        E.compute("reallocate", _batch())


def test_register_checks_kind_and_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        E.register("grpo", lambda b: b)
    with pytest.raises(ValueError, match="kind"):
        E.register("__x", lambda b: b, kind="reward_model")
    with pytest.raises(ValueError, match="stateful"):
        E.register("__y", lambda a, b: a, kind="transform", stateful=True)
    with pytest.raises(ValueError, match="renamed 'old' -> 'missing'"):
        E.register("__z", lambda b, *, scale=1.0: b, renamed={"old": "missing"})


def test_former_hyper_parameter_names_map_in_configs_and_pipelines():
    from jaxrl_agent import config as config_lib

    d = config_lib.to_dict(config_lib.RunConfig())
    d["estimator"] = {"name": "gigpo", "params": {"mode": "mean_norm"},
                      "then": [{"name": "trial", "params": {"lam": 0.5}}]}
    cfg = run_checks.from_dict(d)
    assert cfg.estimator.params == {"normalization": "mean_norm"}
    assert cfg.estimator.then == [{"name": "trial", "params": {"weight": 0.5}}]
    d["estimator"]["params"] = {"mode": "mean_norm", "normalization": "mean_std_norm"}
    with pytest.raises(config_lib.ConfigError,
                       match=r"^estimator.params: .*give 'normalization' only \('mode' is its"):
        run_checks.from_dict(d)
    assert E.Pipeline.build("gigpo", {"mode": "mean_norm"}) == \
        E.Pipeline.build("gigpo", {"normalization": "mean_norm"})


# ----------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("layout", ["concatenated", "per_step"])
def test_pipeline_equals_manual_composition(layout):
    b = _batch(layout)
    hp = {"weights": "w", "clip_max": 1.5}
    base = E.get("grpo")(b)
    want = E.get("reallocate")(base, b, **hp)
    pipe = E.Pipeline.build("grpo", then=[("reallocate", hp)])
    got = jax.jit(pipe)(b)
    via_compute = E.compute("grpo", b, then=[("reallocate", hp)])
    for out in (got, via_compute):
        np.testing.assert_array_equal(np.asarray(out.token), np.asarray(want.token))
        np.testing.assert_array_equal(np.asarray(out.turn), np.asarray(want.turn))
    assert pipe.names == ("grpo", "reallocate")
    hash(pipe)  # static argument of jit


def test_stages_apply_in_order():
    b = _batch()
    one = E.compute("grpo", b, then=[("reallocate", {"weights": "w"})])
    two = E.compute("grpo", b, then=[("reallocate", {"weights": "w"}),
                                     ("reallocate", {"weights": "w", "level": "turn"})])
    # the turn-level pass has one weight per turn: it changes nothing after the first
    np.testing.assert_allclose(np.asarray(two.token), np.asarray(one.token), rtol=1e-6,
                               atol=1e-7)


def test_stateful_estimator_in_a_pipeline():
    b = _batch()
    state = E.spo_init(8)
    adv, new_state = E.compute("spo", b, state=state, then=[("reallocate", {"weights": "w"})])
    ref, ref_state = E.compute("spo", b, state=state)
    want = E.get("reallocate")(ref, b, weights="w")
    np.testing.assert_allclose(np.asarray(adv.token), np.asarray(want.token), rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, new_state, ref_state)
    with pytest.raises(ValueError, match="stateful"):
        E.compute("spo", b, then=[("reallocate", {"weights": "w"})])


def test_pipeline_rejects_bad_stages():
    with pytest.raises(ValueError, match="has no hyper-parameter"):
        E.Pipeline.build("grpo", then=[("reallocate", {"weight": "w"})])
    with pytest.raises(ValueError, match="is an estimator, not a shaping"):
        E.Pipeline.build("grpo", shaping=["grpo"])
    with pytest.raises(ValueError, match="needs extras\\['weights'\\]"):
        E.compute("grpo", _batch(weights=False), then=["reallocate"])


# ----------------------------------------------------------------------------- records


def test_traj_extras_and_edges_records():
    recs = _records(n=3)
    for i, r in enumerate(recs):
        r["traj_extras"] = {"score": 0.25 * i, "vec": [i, 1.0]}
        r["edges"] = [[0, len(r["turns"]) - 1, i % 2]] if i else []
    b, index = pack_records(recs)
    n = index.traj
    np.testing.assert_array_equal(b.extras["score"][n], [0.0, 0.25, 0.5])
    assert b.extras["vec"].shape == (b.num_traj, 2)
    e = b.extras["edges"]
    assert e.shape == (b.num_traj, 4, 3) and e.dtype == np.int32
    assert (e[n[0]] == -1).all()
    np.testing.assert_array_equal(e[n[2], 0], [0, len(recs[2]["turns"]) - 1, 0])
    assert (e[n[2], 1:] == -1).all()


@pytest.mark.parametrize("edit,needle", [
    (lambda r: r[1].pop("traj_extras"), "lacks traj_extras.score"),
    (lambda r: r[1].update(traj_extras={"score": [1.0]}), "traj_extras.score: shape differs"),
    (lambda r: r[1].update(traj_extras={"score": "x"}), "traj_extras.score"),
    (lambda r: r[1].pop("edges"), "lacks 'edges'"),
    (lambda r: r[1].update(edges=[[0, 9]]), "dst_turn = 9 is not a turn"),
    (lambda r: r[1].update(edges=[[0]]), "edges\\[0\\] must be"),
    (lambda r: r[1].update(edges=[[0, 0, -1]]), "type must be >= 0"),
    (lambda r: r[1].update(edges={"a": 1}), "must be a list"),
])
def test_bad_record_signals_name_the_field(edit, needle):
    recs = _records(n=3)
    for r in recs:
        r["traj_extras"] = {"score": 1.0}
        r["edges"] = []
    edit(recs)
    with pytest.raises(RecordError, match=needle):
        pack_records(recs)


def test_validate_checks_edges_and_traj_extras():
    recs = _records(n=3)
    for r in recs:
        r["traj_extras"] = {"score": 1.0}
        r["edges"] = [[0, 0]]
    b, _ = pack_records(recs)
    bad = np.array(b.extras["edges"])
    bad[0, 0, 1] = 7
    with pytest.raises(ValueError, match="extras\\['edges'\\]\\[0, 0\\]"):
        b.replace(extras={**b.extras, "edges": bad}).validate()
    with pytest.raises(ValueError, match="int array \\[N, E, 3\\]"):
        b.replace(extras={**b.extras, "edges": bad[..., :2]}).validate()
    score = np.array(b.extras["score"])
    score[0] = np.nan
    with pytest.raises(ValueError, match="extras\\['score'\\]\\[0\\] is not finite"):
        b.replace(extras={**b.extras, "score": score}).validate()
    score[0], score[-1] = 1.0, np.nan  # padding trajectory: allowed
    b.replace(extras={**b.extras, "score": score}).validate()


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _records()) + "\n")
    return path


def _credit(argv, capsys):
    rc = cli.main(["credit", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_applies_a_reallocation(weights_file, tmp_path, capsys):
    out = tmp_path / "o.jsonl"
    rc, stdout, err = _credit([weights_file, "--estimator", "grpo", "--then", "reallocate",
                               "--set", "reallocate.weights=w", "--set", "reallocate.floor=0.1",
                               "--set", "eps=1e-6", "--out", out], capsys)
    assert rc == 0, err
    assert "grpo" in err and "-> reallocate" in err
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    b, index = pack_records(_records())
    want = E.get("reallocate")(E.get("grpo")(b, eps=1e-6), b, weights="w", floor=0.1)
    for i, row in enumerate(rows):
        np.testing.assert_allclose(row["turn_credit"],
                                   np.asarray(want.turn)[index.traj[i], :len(row["turn_credit"])],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv,needle", [
    (["--then", "reallocate", "--set", "trial.lam=1"], "'trial' is not a --shaping or --then"),
    (["--then", "reallocat"], "unknown transform 'reallocat'"),
    (["--then", "grpo"], "'grpo' is an estimator, not a transform"),
    (["--then", "reallocate", "--set", "reallocate.wieghts=w"], "wieghts"),
    (["--then", "reallocate", "--set", "reallocate.weights=nope"], "extras\\['nope'\\]"),
])
def test_cli_stage_errors(weights_file, tmp_path, capsys, argv, needle):
    rc, _, err = _credit([weights_file, "--estimator", "grpo", *argv, "--out",
                          tmp_path / "o.jsonl"], capsys)
    assert rc == 2
    import re
    assert re.search(needle, err), err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_lists_every_kind(capsys):
    assert cli.main(["estimators"]) == 0
    out = capsys.readouterr().out
    for name in E.names("all"):
        assert name in out
    assert "(--then)" in out and "(--shaping)" in out


# ----------------------------------------------------------------------------- configs


def test_config_stages_validate_and_describe():
    cfg = run_checks.from_dict({"estimator": {"name": "grpo", "then": ["reallocate"]}})
    assert C.stages(cfg.estimator, "then") == (("reallocate", ()),)
    with pytest.raises(C.ConfigError, match=r"reallocate reads extras\['weights'\], which no "
                                            r"source of this run supplies.*signals:"):
        run_checks.validate(cfg)  # weights no source of the default run supplies
    cfg = run_checks.from_dict({"estimator": {"name": "grpo", "then": [
        {"name": "reallocate", "params": {"weights": "switch"}}]},
        "env": {"name": "gridworld"}})
    assert run_checks.from_dict(C.to_dict(cfg)) == cfg


@pytest.mark.parametrize("then,needle", [
    ([{"name": "reallocat"}], "estimator.then\\[0\\]: unknown transform"),
    ([{"name": "reallocate", "params": {"weight": "w"}}], "estimator.then\\[0\\].params.weight"),
    ([{"name": "reallocate", "extra": 1}], "unknown key\\(s\\) \\['extra'\\]"),
    ([3], "must be a stage name"),
    ("reallocate", "must be list"),
])
def test_config_stage_errors(then, needle):
    with pytest.raises(C.ConfigError, match=needle):
        run_checks.validate(run_checks.from_dict({"estimator": {"name": "grpo", "then": then}}))


def test_config_override_sets_stages():
    cfg = run_checks.load(None, ["estimator.then=[{name: shuffled_control, params: {weights: w}}]"],
                  validate=False)
    assert C.stages(cfg.estimator, "then") == (("shuffled_control", (("weights", "w"),)),)
    assert f"{cfg.estimator.name} -> shuffled_control" in C.describe(cfg)


# ----------------------------------------------------------------------------- train step


def test_train_step_runs_the_pipeline():
    """Constant weights leave the update bit-identical (P10); real weights change it."""
    from tests.test_train import _model, _records as step_records, _run_step
    from jaxrl_agent.train.step import StepConfig

    recs = step_records()
    for r in recs:
        for k, t in enumerate(r["turns"]):
            t["turn_extras"] = {"one": 2.0, "w": float(k + 1)}
    b, _ = pack_records(recs, layout="per_step")
    s0, o0 = _run_step(StepConfig(), b)
    s1, o1 = _run_step(StepConfig(then=(("reallocate", (("weights", "one"),)),)), b)
    s2, o2 = _run_step(StepConfig(then=(("reallocate", (("weights", "w"),)),)), b)
    jax.tree.map(np.testing.assert_array_equal, s1.params, s0.params)
    assert float(o1["metrics"]["loss"]) == float(o0["metrics"]["loss"])
    assert np.isfinite(float(o2["metrics"]["loss"]))
    assert float(o2["metrics"]["loss"]) != float(o0["metrics"]["loss"])


def test_extra_levels_disambiguate_shapes():
    """A trajectory vector [N, D] with D = K is not a per-turn array: padding cleanup keeps
    entries past a trajectory's last turn, and NaN there is refused (it is real data)."""
    from jaxrl_agent import segments
    recs = _records(n=3)
    for r in recs:
        r["turns"] = r["turns"][:1]
        r["traj_extras"] = {"vec": [1.0, 2.0, 3.0, 4.0]}
    recs[0]["turns"] = recs[0]["turns"] * 4  # K = 4 = D
    b, index = pack_records(recs)
    assert b.num_turns == 4 and b.extras["vec"].shape == (b.num_traj, 4)
    assert b.extra_level("vec", (b.num_traj, 4)) == "traj"
    assert b.extra_level("w", b.turn_mask.shape) == "turn"
    clean = segments.zero_padding(b)
    np.testing.assert_array_equal(np.asarray(clean.extras["vec"])[index.traj[1]], [1, 2, 3, 4])
    vec = np.array(b.extras["vec"])
    vec[index.traj[1], 3] = np.nan
    with pytest.raises(ValueError, match="extras\\['vec'\\]"):
        b.replace(extras={**b.extras, "vec": vec}).validate()
    with pytest.raises(ValueError, match="declared per traj"):
        b.replace(extras={**b.extras, "vec": vec[:2]}).validate()
