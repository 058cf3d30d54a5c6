"""Sharded train step (issue 8): one step on DP=8, FSDP=8, DP2 x FSDP2 x TP2 and one device
gives the same loss, loss terms, gradients and parameters; a critic (gae), a group (grpo, with KL,
entropy and micro-batches) and a stateful (spo) estimator; remat changes nothing; parameters and
the optimizer state are laid out as the partition rules say and stay so after the step; the
rules, the mesh helpers, the mesh/distributed config checks; and one Trainer run on a 2x2x2 mesh
whose checkpoint restores into an FSDP=8 layout.

Compiles dominate the runtime on CPU, so every compiled step is cached per module (``_STEPS``)
and XLA's backend optimisations are off for this module (the SPMD partitioner still runs; both
sides of every comparison are compiled the same way).
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from jaxrl_agent import estimators, sharding
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.models.config import ModelConfig
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.train import loop
from jaxrl_agent.train.metrics import read_metrics
from jaxrl_agent.train.step import StepConfig, init_state, make_train_step
from tests.test_train import _records, tiny_config

SINGLE, DP8, FSDP8, MIXED = (1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2)
# tensor=2 divides heads (4 x 8), kv_heads (2 x 8), mlp (64), vocab (64); fsdp=8 divides embed (32)
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, value_head=True, qk_norm=True)
# 8 groups of 2; num_traj 32 is divisible by every data*fsdp*micro_batches used here (<= 16)
PAD = {"num_traj": 32, "num_turns": 2, "num_rows": 64, "row_len": 8}
CASES = {
    "grpo": StepConfig(estimator="grpo", kl_coef=0.1, entropy_coef=0.01, micro_batches=2),
    "grpo_remat": StepConfig(estimator="grpo", kl_coef=0.1, entropy_coef=0.01, micro_batches=2,
                             remat=True),
    "gae": StepConfig(estimator="gae", estimator_params=(("gamma", 0.95), ("lam", 0.9)),
                      value_coef=0.5),
    "spo": StepConfig(estimator="spo", estimator_params=(("rho", 0.9),)),
}
# Measured on 2 CPU cores (max |sharded - single|): loss ~4e-9 (relative ~1e-6), loss terms
# <= 5e-7 relative, gradients <= ~3e-9 absolute (largest ~1e-2). The tolerances leave ~10x room.
LOSS_TOL = dict(rtol=2e-5, atol=1e-7)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)
PARAM_TOL = dict(rtol=1e-6, atol=1e-7)
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
            "embed_tokens", "lm_head")


@pytest.fixture(autouse=True, scope="module")
def _module_compiles(fast_compiles):
    """This module's compiles without XLA's backend optimisations; its cache dropped after."""
    yield
    _STEPS.clear()


def _model(seed=0):
    return Transformer(MODEL, rngs=nnx.Rngs(seed))


def _flat(tree):
    """{'layers.0.self_attn.q_proj.kernel': array, ...} of an nnx.State."""
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return {jax.tree_util.keystr(p, simple=True, separator="."):
            (v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in leaves}


def _state(mesh, cfg: StepConfig, opt):
    """Initial train state laid out by the default rules, and its shardings. The reference
    policy differs from the policy (another init), so the KL term has a gradient."""
    model = _model()
    est = estimators.spec(cfg.estimator).init_state(16) if cfg.estimator == "spo" else ()
    state = init_state(model, opt, seed=0, est_state=est, with_reference=cfg.kl_coef > 0)
    if cfg.kl_coef:
        state = state.replace(ref_params=nnx.state(_model(seed=1), nnx.Param))
    sh = sharding.train_state_shardings(state, opt, mesh)
    return model, jax.device_put(state, sh), sh


# sgd with lr 1 and a zero momentum: the parameter change is exactly -gradient and the optimizer
# state (the trace) is the gradient itself, laid out like the parameters (Adam would amplify the
# float noise of near-zero gradients to +-lr).
_OPT = optax.sgd(1.0, momentum=0.0)
_STEPS: dict = {}


def _step(case: str, layout: tuple):
    """One compiled step of ``CASES[case]`` on a ``layout`` mesh (cached per module)."""
    key = (case, layout)
    if key not in _STEPS:
        d, f, t = layout
        mesh = sharding.make_mesh(data=d, fsdp=f, tensor=t)
        cfg = dataclasses.replace(CASES[case], data_shards=d * f)
        model, state, sh = _state(mesh, cfg, _OPT)
        batch, _ = pack_records(_records(n_groups=8, g=2), layout="per_step",
                                num_shards=d * f * cfg.micro_batches, pad_to=PAD)
        batch = jax.device_put(batch, sharding.batch_sharding(mesh))
        p0 = jax.device_get(_flat(state.params))
        fn = make_train_step(model, _OPT, cfg, mesh=mesh, state_shardings=sh)
        new, out = fn(state, batch)
        _STEPS[key] = {
            "mesh": mesh, "shardings": sh, "state0": state, "state": new, "p0": p0,
            "params": jax.device_get(_flat(new.params)),
            "grads": jax.device_get(_flat(new.opt_state[0].trace)),
            "metrics": {k: float(v) for k, v in jax.device_get(out["metrics"]).items()},
            "est": jax.device_get(new.est_state)}
    return _STEPS[key]


def _assert_same_step(got, ref):
    mg, mr = got["metrics"], ref["metrics"]
    assert mg.keys() == mr.keys()
    assert mr["update_skipped"] == mg["update_skipped"] == 0.0
    for k in mr:
        tol = LOSS_TOL
        if k == "adv_mean":  # a mean of normalised advantages is a cancellation near 0: its
            # float32 error scales with the advantages' size, not its own (the sum order
            # differs between a sharded and a single-device run)
            tol = dict(rtol=0.0, atol=1e-6 * max(1.0, mr["adv_abs"]))
        np.testing.assert_allclose(mg[k], mr[k], **tol, err_msg=k)
    assert got["grads"].keys() == ref["grads"].keys()
    for k in ref["grads"]:
        np.testing.assert_allclose(got["grads"][k], ref["grads"][k], **GRAD_TOL, err_msg=k)
        np.testing.assert_allclose(got["params"][k], ref["params"][k], **PARAM_TOL, err_msg=k)
        # sgd(1): the update is minus the gradient
        np.testing.assert_allclose(ref["p0"][k] - ref["params"][k], ref["grads"][k],
                                   atol=2e-7, err_msg=k)


def _max_grad(res, *names):
    return max(float(np.max(np.abs(g))) for k, g in res["grads"].items()
               if any(n in k for n in names))


# ----------------------------------------------------------------------------- the step


@pytest.mark.parametrize("layout", [DP8, FSDP8, MIXED], ids=["dp8", "fsdp8", "dp2xfsdp2xtp2"])
def test_group_estimator_step_matches_single_device(layout):
    """grpo + KL + entropy + 2 micro-batches: loss, every loss term, gradients, parameters."""
    ref = _step("grpo", SINGLE)
    # the terms under test are live: non-zero KL (reference != policy), entropy, gradients
    assert ref["metrics"]["loss_kl"] > 1e-4 and ref["metrics"]["loss_entropy"] > 1.0
    assert ref["metrics"]["adv_abs"] > 0 and _max_grad(ref, "q_proj", "lm_head") > 1e-5
    _assert_same_step(_step("grpo", layout), ref)


def test_critic_estimator_step_matches_single_device():
    """gae reads the value head (a separate forward pass) and trains it."""
    ref, got = _step("gae", SINGLE), _step("gae", MIXED)
    assert ref["metrics"]["loss_value"] > 0 and _max_grad(ref, "value_head") > 1e-4
    _assert_same_step(got, ref)


def test_stateful_estimator_step_matches_single_device():
    """spo runs under shard_map with a replicated tracker; the batch-wide whitening and the
    tracker update are reduced across the 8 batch shards."""
    ref, got = _step("spo", SINGLE), _step("spo", (2, 4, 1))
    init = estimators.spec("spo").init_state(16)
    assert not np.allclose(ref["est"].alpha, init.alpha)  # the tracker moved
    for a, b in ((got["est"].alpha, ref["est"].alpha), (got["est"].beta, ref["est"].beta)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert got["state"].est_state.alpha.sharding.is_fully_replicated
    _assert_same_step(got, ref)


def test_remat_changes_nothing():
    got, ref = _step("grpo_remat", MIXED), _step("grpo", MIXED)
    _assert_same_step(got, ref)
    _assert_same_step(got, _step("grpo", SINGLE))


def test_data_shards_must_match_the_mesh():
    mesh = sharding.make_mesh(data=8)
    with pytest.raises(ValueError, match="data_shards=1 .* data\\*fsdp=8"):
        make_train_step(_model(), _OPT, StepConfig(), mesh=mesh)


# ----------------------------------------------------------------------------- layouts

# per-device shapes by DEFAULT_RULES (embed -> fsdp; heads/kv_heads/mlp/vocab -> tensor); the
# two decoder layers are stacked along a leading axis that is never split.
# parameter: (its shape on MIXED, on FSDP8)
LOCAL_SHAPES = {
    "embed_tokens.embedding": ((32, 16), (64, 4)),
    "layers.self_attn.q_proj.kernel": ((2, 16, 16), (2, 4, 32)),
    "layers.self_attn.k_proj.kernel": ((2, 16, 8), (2, 4, 16)),
    "layers.self_attn.o_proj.kernel": ((2, 16, 16), (2, 32, 4)),
    "layers.mlp.gate_proj.kernel": ((2, 16, 32), (2, 4, 64)),
    "layers.mlp.down_proj.kernel": ((2, 32, 16), (2, 64, 4)),
    "lm_head.kernel": ((16, 32), (4, 64)),
    "layers.input_layernorm.weight": ((2, 32), (2, 32)),
    "norm.weight": ((32,), (32,)),
    "layers.self_attn.q_norm.weight": ((2, 8), (2, 8)),
    "value_head.kernel": ((16, 1), (4, 1)),
    "value_head.bias": ((1,), (1,)),
}
LOCAL = {layout: {path: shapes[j] for path, shapes in LOCAL_SHAPES.items()}
         for j, layout in enumerate((MIXED, FSDP8))}


@pytest.mark.parametrize("layout", [MIXED, FSDP8], ids=["dp2xfsdp2xtp2", "fsdp8"])
def test_parameters_are_sharded_as_the_rules_say(layout):
    mesh = sharding.make_mesh(data=layout[0], fsdp=layout[1], tensor=layout[2])
    _, state, _ = _state(mesh, StepConfig(kl_coef=0.1), _OPT)
    params = _flat(state.params)
    for path, shape in LOCAL[layout].items():
        x = params[path]
        assert len(x.addressable_shards) == 8, path
        assert {s.data.shape for s in x.addressable_shards} == {shape}, path
    # every shard holds a distinct block of a sharded matrix; replicated ones hold it all
    q = params["layers.self_attn.q_proj.kernel"]
    assert len({str(s.index) for s in q.addressable_shards}) == 8 // layout[0]
    assert params["norm.weight"].is_fully_replicated
    # the frozen reference copy and the trace like the parameters; step / rng replicated
    for tree in (state.ref_params, state.opt_state[0].trace):
        for path, x in _flat(tree).items():
            assert x.sharding.is_equivalent_to(params[path].sharding, x.ndim), path
    assert state.step.sharding.is_fully_replicated and state.rng.sharding.is_fully_replicated


def test_adam_state_is_sharded_like_its_parameters():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    _, state, _ = _state(mesh, StepConfig(), opt)
    params = _flat(state.params)
    adam = state.opt_state[1][0]
    for tree in (adam.mu, adam.nu):
        got = _flat(tree)
        assert got.keys() == params.keys()
        for path, x in got.items():
            assert x.sharding.is_equivalent_to(params[path].sharding, x.ndim), path
            assert x.addressable_shards[0].data.shape == \
                params[path].addressable_shards[0].data.shape
    assert adam.count.sharding.is_fully_replicated
    emb = got["embed_tokens.embedding"]
    assert emb.addressable_shards[0].data.shape == (32, 16)


@pytest.mark.parametrize("layout", [MIXED, FSDP8, DP8], ids=["dp2xfsdp2xtp2", "fsdp8", "dp8"])
def test_updated_state_keeps_its_shardings(layout):
    res = _step("grpo", layout)
    sh, new, old = res["shardings"], res["state"], res["state0"]
    leaves_sh = jax.tree.leaves(sh, is_leaf=lambda s: isinstance(s, NamedSharding))
    leaves_new = jax.tree.leaves(new)
    assert len(leaves_sh) == len(leaves_new)
    for s, x in zip(leaves_sh, leaves_new):
        assert x.sharding.is_equivalent_to(s, x.ndim), (s, x.sharding)
    for tree in ("params", "opt_state", "ref_params"):
        assert (sharding.bytes_per_device(getattr(new, tree))
                == sharding.bytes_per_device(getattr(old, tree))), tree


def test_bytes_per_device_scale_with_fsdp_times_tensor():
    def matrices(layout):
        _, state, _ = _state(sharding.make_mesh(data=layout[0], fsdp=layout[1],
                                                tensor=layout[2]), StepConfig(), _OPT)
        p = _flat(state.params)
        return sharding.bytes_per_device([x for k, x in p.items()
                                          if any(m in k for m in MATRICES)]), state
    full, single = matrices(SINGLE)
    assert full == sum(x.nbytes for k, x in _flat(single.params).items()
                       if any(m in k for m in MATRICES))
    assert matrices(DP8)[0] == full
    assert matrices(MIXED)[0] == full // 4
    assert matrices(FSDP8)[0] == full // 8
    # all parameters: the replicated norms / value-head bias add a little
    total = sharding.bytes_per_device(single.params)
    mixed = sharding.bytes_per_device(matrices(MIXED)[1].params)
    assert total // 4 < mixed < total // 4 + 2000


# ----------------------------------------------------------------------------- rules


def test_spec_for_default_rules():
    m = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert sharding.spec_for(("embed", "heads"), (32, 32), m, sharding.DEFAULT_RULES) == \
        (P("fsdp", "tensor"), [])
    assert sharding.spec_for(("vocab", "embed"), (64, 32), m, sharding.DEFAULT_RULES)[0] == \
        P("tensor", "fsdp")
    assert sharding.spec_for(("norm",), (32,), m, sharding.DEFAULT_RULES)[0] == P()
    # trailing replicated dims are dropped from the spec
    assert sharding.spec_for(("embed", None), (32, 1), m, sharding.DEFAULT_RULES)[0] == P("fsdp")
    # a size-1 mesh axis is not used (no note)
    dp = sharding.make_mesh(data=8)
    assert sharding.spec_for(("embed", "mlp"), (32, 64), dp, sharding.DEFAULT_RULES) == (P(), [])
    assert sharding.spec_for(None, (3, 4), m, sharding.DEFAULT_RULES) == (P(), [])
    with pytest.raises(ValueError, match="do not match"):
        sharding.spec_for(("embed",), (32, 32), m, sharding.DEFAULT_RULES)


def test_spec_for_drops_an_axis_that_does_not_divide():
    m = sharding.make_mesh(fsdp=8)
    spec, notes = sharding.spec_for(("embed", "mlp"), (12, 64), m, sharding.DEFAULT_RULES)
    assert spec == P() and len(notes) == 1
    assert "embed" in notes[0] and "12" in notes[0] and "fsdp=8" in notes[0]
    # only the non-dividing dimension is replicated
    m = sharding.make_mesh(fsdp=2, tensor=4)
    spec, notes = sharding.spec_for(("embed", "vocab"), (32, 62), m, sharding.DEFAULT_RULES)
    assert spec == P("fsdp") and notes == ["vocab: size 62 not divisible by tensor=4"]


def test_spec_for_never_uses_a_mesh_axis_twice():
    m = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    rules = {"embed": "fsdp", "mlp": ["fsdp", "tensor"]}
    spec, notes = sharding.spec_for(("embed", "mlp"), (32, 64), m, rules)
    assert spec == P("fsdp", "tensor") and "already used" in notes[0]
    spec, notes = sharding.spec_for(("heads", "heads"), (32, 32), m, sharding.DEFAULT_RULES)
    assert spec == P("tensor") and len(notes) == 1
    for a, b in [(("embed", "mlp"), (64, 32)), (("mlp", "embed"), (64, 32))]:
        spec, _ = sharding.spec_for(a, b, m, {"embed": ["fsdp", "tensor"], "mlp": "tensor"})
        flat = [x for p in spec if p is not None for x in ((p,) if isinstance(p, str) else p)]
        assert len(flat) == len(set(flat)), spec


def test_unknown_logical_names_are_replicated():
    m = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    assert sharding.spec_for(("foo", "bar"), (32, 32), m, sharding.DEFAULT_RULES) == (P(), [])
    assert sharding.spec_for(("foo", "embed"), (32, 32), m, {"embed": "tensor"})[0] == \
        P(None, "tensor")


@pytest.mark.parametrize("rules,name", [({"embed": "model"}, "embed"),
                                        ({"mlp": ["tensor", "tensor"]}, "mlp"),
                                        ({"vocab": ["fsdp", "x"]}, "vocab")])
def test_check_rules_rejects_bad_axes(rules, name):
    with pytest.raises(ValueError, match=rf"mesh\.rules\.{name}"):
        sharding.check_rules(rules)
    with pytest.raises(ValueError, match=rf"mesh\.rules\.{name}"):
        sharding.spec_for(("embed",), (32,), sharding.make_mesh(data=8), rules)


def test_check_rules_normalises():
    assert sharding.check_rules({"a": None, "b": "fsdp", "c": ["fsdp", "tensor"]}) == \
        {"a": (), "b": ("fsdp",), "c": ("fsdp", "tensor")}


def test_custom_rules_change_the_layout():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    rules = {**sharding.DEFAULT_RULES, "embed": None, "mlp": ["fsdp", "tensor"]}
    params = nnx.state(nnx.eval_shape(_model), nnx.Param)
    specs = _flat(sharding.param_specs(params, mesh, rules))
    assert specs["layers.mlp.gate_proj.kernel"] == P(None, None, ("fsdp", "tensor"))
    assert specs["layers.mlp.down_proj.kernel"] == P(None, ("fsdp", "tensor"))
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, None, "tensor")
    assert specs["embed_tokens.embedding"] == P("tensor")
    default = _flat(sharding.param_specs(params, mesh))
    assert default["layers.mlp.gate_proj.kernel"] == P(None, "fsdp", "tensor")
    # real arrays follow the custom specs
    model = _model()
    opt = optax.sgd(1.0)
    state = init_state(model, opt, seed=0)
    state = jax.device_put(state, sharding.train_state_shardings(state, opt, mesh, rules))
    gate = _flat(state.params)["layers.mlp.gate_proj.kernel"]
    assert gate.addressable_shards[0].data.shape == (2, 32, 16)


def test_layout_table_rows():
    mesh = sharding.make_mesh(fsdp=2, tensor=4)
    cfg = ModelConfig(vocab_size=62, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=4, head_dim=8, value_head=True)
    params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    rows = {r["path"]: r for r in sharding.layout_table(params, mesh)}
    assert len(rows) == len(jax.tree.leaves(params))
    assert set(rows["lm_head.kernel"]) == {"path", "shape", "axes", "spec", "local_shape",
                                           "notes"}
    q = rows["layers.self_attn.q_proj.kernel"]
    assert (q["shape"], q["axes"], q["spec"], q["local_shape"], q["notes"]) == \
        ((1, 32, 32), ("layers", "embed", "heads"), P(None, "fsdp", "tensor"), (1, 16, 8), [])
    emb = rows["embed_tokens.embedding"]  # 62 rows do not split 4 ways
    assert emb["spec"] == P(None, "fsdp") and emb["local_shape"] == (62, 16)
    assert emb["notes"] == ["vocab: size 62 not divisible by tensor=4"]
    assert rows["norm.weight"]["spec"] == P() and rows["norm.weight"]["local_shape"] == (32,)


# ----------------------------------------------------------------------------- mesh


def test_resolve_axes():
    assert sharding.resolve_axes(-1, num_devices=8) == (8, 1, 1)
    assert sharding.resolve_axes(2, -1, 2, num_devices=8) == (2, 2, 2)
    assert sharding.resolve_axes(1, 1, -1, num_devices=4) == (1, 1, 4)
    assert sharding.resolve_axes(2, 2, 1, num_devices=8) == (2, 2, 1)
    with pytest.raises(ValueError, match="at most one"):
        sharding.resolve_axes(-1, -1, num_devices=8)
    with pytest.raises(ValueError, match="do not divide"):
        sharding.resolve_axes(3, -1, num_devices=8)
    with pytest.raises(ValueError, match="only 8 devices"):
        sharding.resolve_axes(4, 4, num_devices=8)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match="mesh.fsdp"):
            sharding.resolve_axes(1, bad, num_devices=8)


def test_make_mesh():
    m = sharding.make_mesh(data=-1)
    assert dict(m.shape) == {"data": 8, "fsdp": 1, "tensor": 1}
    assert m.axis_names == sharding.AXES
    assert tuple(m.axis_types) == (AxisType.Auto,) * 3
    m = sharding.make_mesh(data=2, fsdp=-1, tensor=2)
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2} and sharding.batch_shards(m) == 4
    small = sharding.make_mesh(data=2, tensor=2)  # a smaller mesh uses the first devices
    assert list(small.devices.flat) == jax.devices()[:4]
    assert sharding.batch_shards(small) == 2
    with pytest.raises(ValueError):
        sharding.make_mesh(data=3, fsdp=3)
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh(data=-1, tensor=-1)
    # the config section, a dict, keyword overrides and explicit devices
    sec = config_lib.MeshSection(data=2, fsdp=4, tensor=1)
    assert dict(sharding.make_mesh(sec).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    m = sharding.make_mesh(run_checks.load(None, ["mesh.fsdp=2", "mesh.tensor=2"]).mesh)
    assert dict(m.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sharding.make_mesh({"fsdp": 4}).shape) == {"data": 1, "fsdp": 4, "tensor": 1}
    assert dict(sharding.make_mesh(sec, fsdp=-1).shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    m = sharding.make_mesh(data=-1, devices=jax.devices()[4:])
    assert dict(m.shape)["data"] == 4 and list(m.devices.flat) == jax.devices()[4:]
    assert sharding.batch_sharding(m).spec == P(("data", "fsdp"))
    assert sharding.replicated(m).spec == P()


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("overrides,match", [
    (["mesh.rules.embed=model"], r"mesh\.rules\.embed"),
    (["mesh.rules={mlp: [tensor, tensor]}"], r"mesh\.rules\.mlp"),
    (["run.dir=gs://bucket/run"], r"mount the bucket"),
    (["distributed.num_processes=0"], r"distributed\.num_processes must be >= 1"),
    (["distributed.num_processes=2", "distributed.process_id=2"], r"distributed\.process_id"),
    (["distributed.process_id=-1"], r"distributed\.process_id"),
])
def test_config_rejects_bad_mesh_rules_and_distributed(overrides, match):
    with pytest.raises(config_lib.ConfigError, match=match):
        run_checks.load(None, overrides)


def test_config_accepts_rules_and_distributed():
    cfg = run_checks.load(None, ["mesh.rules={embed: null, mlp: [fsdp, tensor]}",
                                 "distributed.coordinator_address=h:1234",
                                 "distributed.num_processes=2", "distributed.process_id=1"])
    assert cfg.mesh.rules == {"embed": None, "mlp": ["fsdp", "tensor"]}
    assert cfg.distributed.process_id == 1
    # a partial section is fine in the YAML: the rest comes from $JAXRL_* on each host, and
    # completeness is checked after that merge (multihost.resolve_settings)
    part = run_checks.load(None, ["distributed.coordinator_address=h:1234"])
    from jaxrl_agent.sharding import multihost
    with pytest.raises(ValueError, match="num_processes"):
        multihost.resolve_settings(**dataclasses.asdict(part.distributed), env={})
    got = multihost.resolve_settings(**dataclasses.asdict(part.distributed),
                                     env={"JAXRL_NUM_PROCESSES": "2", "JAXRL_PROCESS_ID": "1"})
    assert (got.num_processes, got.process_id) == (2, 1)


# ----------------------------------------------------------------------------- the trainer

TRAINER = ["mesh.fsdp=2", "mesh.tensor=2", "model.num_kv_heads=2", "model.num_heads=2",
           "trainer.micro_batches=2", "trainer.remat=true", "trainer.steps=2",
           "trainer.eval_every=0", "metrics.plots=false", "checkpoint.every=1",
           "loss.entropy_coef=0.01", "estimator.name=turn_gae", "model.value_head=true"]
# (a critic: the untrained policy fails every task, and outcome-only advantages would all be 0,
# so every update would be skipped for want of signal)


def test_trainer_on_a_2x2x2_mesh_restores_into_fsdp8(tmp_path):
    # the JAX sampler on its own layout: rows over 4 devices, heads over 2
    cfg = tiny_config(tmp_path, *TRAINER, "mesh.data=2", "sampler.data_parallel=-1",
                      "sampler.tensor_parallel=2")
    tr = loop.Trainer(cfg, progress=False)
    assert dict(tr.mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2} and tr.data_shards == 4
    assert dict(tr.sampler.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    summary = tr.layout_summary()
    assert "mesh data=2 fsdp=2 tensor=2" in summary and "remat" in summary
    saved = {}
    real_save = tr.checkpointer.save

    def save(step, state, meta, force=False):  # the run's own state at every step
        saved[step] = (jax.device_get(state), state.params)
        return real_save(step, state, meta, force=force)

    tr.checkpointer.save = save
    assert tr.run().steps == 2
    rows = read_metrics(tmp_path / "metrics" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/update_skipped"] == 0 and r["train/grad_norm"] > 0 for r in rows)
    final, live = saved[2]
    q = _flat(live)["layers.self_attn.q_proj.kernel"]  # (layers, 32, 2 x 32): embed/fsdp x
    # heads/tensor
    assert q.shape[1:] == (32, 64) and q.addressable_shards[0].data.shape[1:] == (16, 32)
    assert not np.allclose(jax.device_get(_flat(saved[1][0].params)["lm_head.kernel"]),
                           _flat(final.params)["lm_head.kernel"])  # it trained
    # each sync moved the weights from the train layout to the sampler's: whole embed, heads
    # split over its tensor axis, the values of the step the sampler's version names
    sq = tr.sampler.state["layers"]["self_attn"]["q_proj"]["kernel"][...]
    assert sq.addressable_shards[0].data.shape[1:] == (32, 32)
    version = tr.sampler.policy_version
    assert version in saved
    np.testing.assert_array_equal(
        jax.device_get(sq), _flat(saved[version][0].params)["layers.self_attn.q_proj.kernel"])

    cfg2 = tiny_config(tmp_path, *TRAINER, "mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1")
    tr2 = loop.Trainer(cfg2, resume=True, progress=False)  # the mesh may change on resume
    try:
        assert "mesh data=1 fsdp=8 tensor=1" in tr2.layout_summary()
        state, meta = tr2.checkpointer.restore(tr2._fresh_state())
    finally:
        tr2.checkpointer.close()
        tr2.close()
    assert int(meta["step"]) == 2 and int(state.step) == 2
    want = jax.tree.leaves(final)
    got = jax.tree.leaves(state)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(jax.device_get(a), b)
    for x, s in zip(got, jax.tree.leaves(tr2.state_shardings,
                                         is_leaf=lambda s: isinstance(s, NamedSharding))):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    q = _flat(state.params)["layers.self_attn.q_proj.kernel"]
    assert q.addressable_shards[0].data.shape[1:] == (4, 64)
    mu = _flat(state.opt_state[1][0].mu)["layers.self_attn.q_proj.kernel"]  # adamw
    assert mu.addressable_shards[0].data.shape[1:] == (4, 64)
