"""LoRA adapters on a frozen base (issue 33): the adapted model starts equal to the base bit
for bit; ``lora_matmul``'s low-rank backward equals the gradient of its formula; only the
adapters (and the value head) get gradients and optimizer state, the base keeps its values;
a LoRA step on a data x fsdp x tensor mesh equals the single-device step; the merged HF export
and the PEFT adapter folder give the adapted model's logits in transformers / peft."""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jaxrl_agent import config as config_lib
from jaxrl_agent import run_checks
from jaxrl_agent import sharding
from jaxrl_agent.models import (LoRAParam, ModelConfig, Transformer, load_hf, load_peft_adapter,
                                lora_paths, save_hf, save_peft_adapter, to_hf_tensors,
                                trainable_filter)
from jaxrl_agent.models.transformer import lora_matmul
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.train.step import StepConfig, init_state, make_train_step, split_trainable
from tests.test_train import _records

BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=8, qk_norm=True, family="qwen3")
LORA = BASE.replace(lora_rank=4, lora_alpha=8.0)
PAD = {"num_traj": 16, "num_turns": 2, "num_rows": 32, "row_len": 8}


def _tokens(seed=0, shape=(3, 12), vocab=64):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, shape), jnp.int32)


def _perturb_adapters(model, seed=1, scale=0.05):
    """Non-zero ``lora_b`` (a trained adapter), so the adapter's path is exercised."""
    rng = np.random.RandomState(seed)
    for path in lora_paths(model.config):
        lin = model
        for key in path:
            lin = getattr(lin, key)
        lin.lora_b.set_value(jnp.asarray(rng.normal(0, scale, lin.lora_b.shape), jnp.float32))


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step0_logits_are_bit_equal_to_the_base(dtype):
    base = Transformer(BASE.replace(dtype=dtype), rngs=nnx.Rngs(0))
    lora = Transformer(LORA.replace(dtype=dtype), rngs=nnx.Rngs(0))
    toks = _tokens()
    # the same base weights (the adapters are drawn after them) ...
    b_params, _ = nnx.split_state(nnx.state(lora, nnx.Param), nnx.Not(LoRAParam), ...)
    for x, y in zip(jax.tree.leaves(nnx.state(base, nnx.Param)), jax.tree.leaves(b_params)):
        assert x.dtype == y.dtype and bool(jnp.all(x == y))
    # ... and the same logits, eagerly and compiled (with remat and blocked attention)
    assert bool(jnp.all(base(toks).logits == lora(toks).logits))
    f = lambda m: jax.jit(lambda t: m(t, remat="full", attention="blocked").logits)(toks)  # noqa: E731
    assert bool(jnp.all(f(base) == f(lora)))
    # a trained adapter changes them
    _perturb_adapters(lora)
    assert float(jnp.max(jnp.abs(base(toks).logits - lora(toks).logits))) > 1e-3


@settings(max_examples=15, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=1, max_size=2), din=st.integers(1, 9),
       dout=st.integers(1, 9), r=st.integers(1, 4), scale=st.floats(0.1, 4.0),
       seed=st.integers(0, 2 ** 16))
def test_lora_matmul_gradients_equal_the_merged_formula(lead, din, dout, r, scale, seed):
    """The custom backward (low-rank da, db; dw for when the base is trained) against the
    autodiff of ``x @ (w + scale a b)``."""
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], tuple(lead) + (din,))
    w, a = jax.random.normal(ks[1], (din, dout)), jax.random.normal(ks[2], (din, r))
    b, c = jax.random.normal(ks[3], (r, dout)), jax.random.normal(ks[4], tuple(lead) + (dout,))
    ours = lambda x, w, a, b: jnp.sum(c * jnp.tanh(lora_matmul(x, w, a, b, scale)))  # noqa: E731
    ref = lambda x, w, a, b: jnp.sum(c * jnp.tanh(x @ (w + scale * a @ b)))  # noqa: E731
    np.testing.assert_allclose(ours(x, w, a, b), ref(x, w, a, b), rtol=1e-5, atol=1e-5)
    for g, h in zip(jax.grad(ours, (0, 1, 2, 3))(x, w, a, b),
                    jax.grad(ref, (0, 1, 2, 3))(x, w, a, b)):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-4)


def test_trainable_filter_and_lora_config_errors():
    model = Transformer(LORA.replace(value_head=True, lora_train_norms=True), rngs=nnx.Rngs(0))
    trained, frozen = split_trainable(nnx.state(model, nnx.Param), trainable_filter(model.config))
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(trained)}
    assert "layers/self_attn/q_proj/lora_a" in names and "value_head/kernel" in names
    assert "layers/input_layernorm/weight" in names and "norm/weight" in names
    assert not any(n.endswith("kernel") and "value_head" not in n for n in names)
    assert trainable_filter(BASE) is nnx.Param  # no LoRA: everything is trained
    for bad in (dict(lora_rank=-1), dict(lora_rank=2, lora_targets=("q_proj", "wq")),
                dict(lora_rank=2, lora_alpha=0.0)):
        with pytest.raises(ValueError, match="lora"):
            BASE.replace(**bad)
    for sets, words in ((["model.lora.rank=-2"], "model.lora.rank"),
                        (["model.lora.rank=4", "model.lora.targets=[q_proj,wq]"],
                         "model.lora.targets")):
        with pytest.raises(config_lib.ConfigError, match=words):
            run_checks.load(None, sets)


def test_a_rank_as_large_as_the_matrix_is_refused_naming_the_largest_valid_one(
        tiny_checkpoint):
    # BASE: q/o 32 x 32 (4 heads of 8), k/v 32 x 16 (2 heads), gate/up 32 x 64, down 64 x 32
    with pytest.raises(ValueError, match=r"k_proj \(32 x 16\); the largest valid rank is 15"):
        BASE.replace(lora_rank=16)
    assert BASE.replace(lora_rank=31, lora_targets=("gate_proj",)).lora_rank == 31
    small = ["model.hidden_size=128", "model.num_heads=4", "model.num_kv_heads=1",
             "model.intermediate_size=512"]
    with pytest.raises(config_lib.ConfigError,
                       match=r"model.lora.rank 32 .* k_proj \(128 x 32\).*largest valid rank is 31"):
        run_checks.load(None, small + ["model.lora.rank=32"])
    # only the targeted matrices count: without k/v the smallest side is 128
    ok = run_checks.load(None, small + ["model.lora.rank=32",
                                        "model.lora.targets=[q_proj,o_proj,gate_proj]"])
    assert ok.model.lora.rank == 32
    # a checkpoint's shapes come from its config.json (check_paths, before anything is built)
    hf = json.loads((tiny_checkpoint / "config.json").read_text())
    side = min(hf["hidden_size"], hf["num_key_value_heads"] * (
        hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]))
    cfg = run_checks.load(None, [f"model.hf_path={tiny_checkpoint}",
                                 f"model.lora.rank={side}"])
    with pytest.raises(config_lib.ConfigError, match=f"largest valid rank is {side - 1}"):
        config_lib.check_paths(cfg)


# ----------------------------------------------------------------------------- the step


_OPT = optax.sgd(1.0, momentum=0.0)  # the update is minus the gradient; the trace holds it
_CFG = StepConfig(estimator="grpo", kl_coef=0.1, entropy_coef=0.01, micro_batches=2)
_RUNS: dict = {}


def _lora_step(layout):
    """One GRPO + KL step of the LoRA model (non-zero adapters) on a ``layout`` mesh."""
    if layout not in _RUNS:
        d, f, t = layout
        mesh = sharding.make_mesh(data=d, fsdp=f, tensor=t)
        cfg = dataclasses.replace(_CFG, data_shards=d * f)
        model = Transformer(LORA.replace(value_head=True), rngs=nnx.Rngs(0))
        _perturb_adapters(model)
        state = init_state(model, _OPT, seed=0, with_reference=True)
        sh = sharding.train_state_shardings(state, _OPT, mesh,
                                            trainable=trainable_filter(model.config))
        state = jax.device_put(state, sh)
        batch, _ = pack_records(_records(n_groups=8, g=2), layout="per_step",
                                num_shards=d * f * cfg.micro_batches, pad_to=PAD)
        batch = jax.device_put(batch, sharding.batch_sharding(mesh))
        before = jax.device_get(state.params)
        new, out = make_train_step(model, _OPT, cfg, mesh=mesh, state_shardings=sh)(state, batch)
        _RUNS[layout] = dict(before=before, after=jax.device_get(new.params),
                             trace=jax.device_get(new.opt_state[0].trace), state=new,
                             metrics=jax.device_get(out["metrics"]))
    return _RUNS[layout]


def _flat(tree):
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(tree)}


def test_step_trains_the_adapters_only_and_keeps_the_base():
    run = _lora_step((1, 1, 1))
    before, after, trace = _flat(run["before"]), _flat(run["after"]), _flat(run["trace"])
    # gradients (the sgd trace) and optimizer state exist for the adapters and value head only
    assert set(trace) == {k for k in before if "lora_" in k or "value_head" in k}
    for k, v in before.items():
        if k in trace:
            np.testing.assert_allclose(v - after[k], trace[k], atol=1e-6, err_msg=k)
        else:
            assert np.array_equal(v, after[k]), k  # the frozen base, bit for bit
    # both adapter matrices learn (a's gradient goes through b, which is non-zero here)
    for name in ("layers/self_attn/q_proj/lora_a", "layers/mlp/down_proj/lora_b"):
        assert float(np.max(np.abs(trace[name]))) > 1e-6, name
    assert run["metrics"]["loss_kl"] >= 0 and run["metrics"]["update_skipped"] == 0


def test_optimizer_state_is_the_adapters_size():
    model = Transformer(LORA, rngs=nnx.Rngs(0))
    adam = optax.adamw(1e-3)
    state = init_state(model, adam, seed=0, with_reference=True)
    size = lambda t: sum(x.size for x in jax.tree.leaves(t))  # noqa: E731
    trained, frozen = split_trainable(state.params, trainable_filter(model.config))
    assert size(frozen) > 5 * size(trained)
    assert size(state.opt_state) == 2 * size(trained) + 1  # mu, nu and the step count
    assert size(state.ref_params) == size(trained)  # the KL reference shares the frozen base


def test_sharded_lora_step_equals_the_single_device_step():
    """data 2 x fsdp 2 x tensor 2: the adapters are laid out with their base matrices' axes
    (lora_a ``(embed, None)``, lora_b ``(None, heads)``), and the step gives the same
    parameters."""
    ref, got = _lora_step((1, 1, 1)), _lora_step((2, 2, 2))
    a = got["state"].params["layers"]["self_attn"]["q_proj"]["lora_a"].get_value()
    b = got["state"].params["layers"]["self_attn"]["q_proj"]["lora_b"].get_value()
    assert a.sharding.spec[:2] == (None, "fsdp") and b.sharding.spec[-1] == "tensor"
    r, g = _flat(ref["after"]), _flat(got["after"])
    for k in r:
        np.testing.assert_allclose(g[k], r[k], rtol=1e-5, atol=2e-7, err_msg=k)


# ----------------------------------------------------------------------------- export


def test_merged_export_and_peft_round_trip(tmp_path):
    model = Transformer(LORA.replace(tie_word_embeddings=False), rngs=nnx.Rngs(0))
    _perturb_adapters(model)
    toks = _tokens(2)
    want = np.asarray(model(toks).logits)
    # merged: a plain model (no adapters) with the same logits
    save_hf(model, None, str(tmp_path / "merged"))
    plain, cfg = load_hf(str(tmp_path / "merged"))
    assert cfg.lora_rank == 0
    np.testing.assert_allclose(np.asarray(plain(toks).logits), want, atol=2e-5)
    # PEFT folder: the adapters alone, read back into a LoRA model of the same base
    save_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path="base")
    peft_cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert peft_cfg["r"] == 4 and peft_cfg["lora_alpha"] == 8.0
    fresh = Transformer(LORA.replace(tie_word_embeddings=False), rngs=nnx.Rngs(0))
    load_peft_adapter(fresh, str(tmp_path / "adapter"))
    assert bool(jnp.all(fresh(toks).logits == model(toks).logits))
    other = Transformer(LORA.replace(tie_word_embeddings=False, lora_rank=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="the adapter has"):
        load_peft_adapter(other, str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(plain, str(tmp_path / "nothing"))
    assert set(to_hf_tensors(model)) == set(to_hf_tensors(plain))


def test_peft_loads_our_adapter_with_the_same_logits(tmp_path):
    """A tiny HF Qwen2 checkpoint: our LoRA model on it (trained-looking adapters) against
    ``peft.PeftModel.from_pretrained(hf_model, our_adapter_folder)`` in torch, float32."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.hf_fixtures import VARIANTS, make_hf_model

    family, kw = VARIANTS["qwen2_tied"]
    hf = make_hf_model(family, tmp_path / "base", seed=3, **kw)
    model, cfg = load_hf(str(tmp_path / "base"), lora_rank=4, lora_alpha=8.0)
    assert cfg.lora_rank == 4
    _perturb_adapters(model, scale=0.1)
    save_peft_adapter(model, str(tmp_path / "adapter"),
                      base_model_name_or_path=str(tmp_path / "base"))
    toks = np.random.RandomState(0).randint(0, 256, (2, 16))
    with torch.no_grad():  # (peft injects the adapter into hf's modules: the base first)
        base = hf(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()
        pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
        ref = pm(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()
    got = np.asarray(model(jnp.asarray(toks, jnp.int32)).logits)
    assert np.max(np.abs(ref - base)) > 1e-2  # the adapter matters
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- runs


def test_a_lora_run_checkpoints_the_adapters_and_resumes_whole(tmp_path):
    """A tiny LoRA run (with a warm-up that trains the base): its checkpoints hold the
    adapters and their optimizer state, not the base; resume and eval rebuild the whole
    model (the merged export of the finished run equals the restored state's)."""
    from jaxrl_agent.train import loop
    from jaxrl_agent.models import load_hf
    from tests.runs import tiny_config

    cfg = tiny_config(tmp_path / "run", "model.lora.rank=4", "trainer.steps=2",
                      "trainer.warmup_sft_steps=2", "checkpoint.every=1")
    loop.Trainer(cfg, progress=False).run()
    assert (tmp_path / "run" / "lora_base" / "config.json").exists()
    t = loop.Trainer(cfg, resume=True, progress=False, read_only=True)
    try:
        # what a checkpoint holds of the parameters: the adapters alone
        saved = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(t._restore_target().params)}
        assert saved and all("lora_" in k for k in saved), saved
        step, state, _ = t._restore_newest_readable()
        assert step == 2
        nnx.update(t.model, state.params)
        want, _ = load_hf(str(tmp_path / "run" / "final_model"))
        got = to_hf_tensors(t.model)
        for k, v in to_hf_tensors(want).items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
    finally:
        t.close()
    res = loop.evaluate_run(str(tmp_path / "run"))
    assert res["step"] == 2
    # the PEFT adapter names the base it was trained on (the warm-up's), and on that base it
    # is the merged export (issue 45)
    adapter = tmp_path / "run" / "final_model" / "adapter"
    named = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == os.path.abspath(tmp_path / "run" / "lora_base")
    on_base, _ = load_hf(named, lora_rank=4, lora_alpha=cfg.model.lora.alpha)
    load_peft_adapter(on_base, str(adapter))
    merged, _ = load_hf(str(tmp_path / "run" / "final_model"))
    got = to_hf_tensors(on_base)
    for k, v in to_hf_tensors(merged).items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_run_that_trains_the_norms_writes_no_adapter_it_could_not_hold(tmp_path, capsys):
    from jaxrl_agent.train import loop
    from tests.runs import tiny_config

    cfg = tiny_config(tmp_path / "run", "model.lora.rank=4", "model.lora.train_norms=true",
                      "trainer.steps=1", "trainer.eval_every=0")
    loop.Trainer(cfg, progress=True, stream=sys.stdout).run()
    assert (tmp_path / "run" / "final_model" / "config.json").exists()
    assert not (tmp_path / "run" / "final_model" / "adapter").exists()
    assert "no adapter/ folder: model.lora.train_norms" in capsys.readouterr().out
