"""``jaxrl-agent plan`` (issue 23): the real train step compiled ahead of time for a topology,
from shapes only, and the JAX sampler's prefill and decode step for one of its devices. On host
devices (``cpu:8``: the conftest's 8 CPU devices) always; for a TPU v5e 2x2 slice when libtpu
(the ``tpu-aot`` extra) is installed, skipped otherwise. Shapes are tiny so each compile takes
seconds; user mistakes exit 2 with one line and no traceback.
"""

import dataclasses
import os
import types

import pytest
from flax import nnx

from jaxrl_agent import cli
from jaxrl_agent import run_checks
from jaxrl_agent.models.transformer import Transformer
from jaxrl_agent.train import build
from jaxrl_agent.train import plan as plan_lib

# tiny rollouts: 8 tasks x 2 = 16 trajectories of up to 2 turns, rows of 32 tokens; the
# sampler's largest call is those 16 prompts (8 eval tasks)
SMALL = ["rollout.tasks_per_step=8", "rollout.group_size=2", "rollout.max_turns=2",
         "rollout.max_new_tokens=8", "rollout.max_context_tokens=32",
         "trainer.micro_batches=2", "trainer.eval_tasks=8"]
FSDP_TP = ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]

needs_libtpu = pytest.mark.skipif(
    not plan_lib.libtpu_available(),
    reason='libtpu is not installed (pip install -e ".[tpu-aot]"): TPU compile not checked')


def _cfg(*sets):
    return run_checks.load(None, list(SMALL) + list(sets), validate=False)


@pytest.fixture
def keep_env():
    """plan sets TPU_* variables for libtpu; the rest of the session must not see them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


HLO = """
  %all-gather.11 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} all-gather(%convert.4), channel_id=1
  %ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), dimensions={0}
  %agd = f32[16,8]{1,0} all-gather-done(%ags)
  ROOT %all-reduce = f32[]{:T(128)} all-reduce(%fusion), channel_id=4, to_apply=%region
  %rs = f32[2,3]{1,0} reduce-scatter(%x), dimensions={0}
  %cp = (s32[5]{0}, u32[]) collective-permute-start(%y)
  %fusion.3 = f32[8]{0} fusion(%all-gather.11), kind=kLoop
  %fusion.430 = (f32[128,32]{0,1:T(8,128)S(1)}, f32[64,32]{0,1}) fusion(%a, %b), kind=kCustom, \
calls=%all-reduce-scatter.15, backend_config={}
}

%all-reduce-scatter.15 (input_0: f32[128,64], input_1: f32[64,64]) -> (f32[128,32], f32[64,32]) {
  %ar = (f32[128,64]{1,0}, f32[64,64]{1,0}) all-reduce(%input_0, %input_1), to_apply=%add
}
"""


def test_count_collectives_reads_ops_and_result_bytes():
    c = plan_lib.count_collectives(HLO)
    assert c["all-gather"] == {"count": 2, "bytes": 512 * 1024 * 2 + 16 * 8 * 4,
                               "max_bytes": 512 * 1024 * 2}
    assert c["all-reduce"]["count"] == 1 and c["all-reduce"]["bytes"] == 4
    # one plain reduce-scatter and one TPU fused all-reduce-scatter (its inner all-reduce is
    # not counted again)
    assert c["reduce-scatter"] == {"count": 2, "bytes": 24 + (128 + 64) * 32 * 4,
                                   "max_bytes": (128 + 64) * 32 * 4}
    assert c["collective-permute"]["count"] == 1 and c["collective-permute"]["bytes"] == 20
    assert c["all-to-all"]["count"] == 0


# a scan of 28 layers with a 4-trip loop inside; one asynchronous all-gather split over two
# fused computations (same channel: counted once), one in the scanned body, one in the entry
LOOPS = """
%cond.28 (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %c = s32[]{:T(128)} constant(28)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%cond.4 (p: (u32[], f32[8])) -> pred[] {
  %c4 = u32[]{:T(128)} constant(4), metadata={op_name="x"}
  %p = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c4), direction=LT
}

%start (a: bf16[1,64]) -> bf16[8,64] {
  %ag.1 = bf16[8,64]{1,0} all-gather(%a), channel_id=7, replica_groups=[2,8]<=[8,2]T(1,0), \
dimensions={0}
}

%done (a: bf16[1,64]) -> bf16[8,64] {
  %ag.2 = bf16[8,64]{1,0} all-gather(%a), channel_id=7, replica_groups=[2,8]<=[8,2]T(1,0), \
dimensions={0}
}

%inner (p: (u32[], f32[8])) -> (u32[], f32[8]) {
  %ag.3 = f32[4,8]{1,0} all-gather(%x), channel_id=9, replica_groups=[8,2]<=[16], dimensions={0}
  %ar.1 = f32[32]{0} all-reduce(%g), channel_id=12, replica_groups=[2,8]<=[8,2]T(1,0), \
to_apply=%add
}

%all-reduce-scatter.3 (input_0: f32[64]) -> f32[8] {
  %ar.2 = f32[64]{0} all-reduce(%input_0), channel_id=13, replica_groups=[2,8]<=[8,2]T(1,0)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %f1 = bf16[8,64] fusion(%w), kind=kCustom, calls=%start
  %f2 = bf16[8,64] fusion(%f1), kind=kCustom, calls=%done
  %w4 = (u32[], f32[8]) while(%t), condition=%cond.4, body=%inner
  %rs.1 = f32[8] fusion(%w), kind=kCustom, calls=%all-reduce-scatter.3
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[8]) while(%t0), condition=%cond.28, body=%body
  %ag.4 = f32[16]{0} all-gather(%a), channel_id=11, \
replica_groups=mesh['axis_0'=2,'axis_1'=8], device_ids=([8,2]T(1,0)) {'axis_0'}, dimensions={0}
}
"""


#: a decode step as the TPU compiler writes it: a layer's cache slice copied into VMEM (S(1))
#: and read by two fusions, a plain copy into VMEM read once, an in-place scatter into VMEM,
#: an asynchronous weight prefetch, a tuple and a dot's result in VMEM, a fusion left in HBM
ON_CHIP = """HloModule decode

%ds (p0: bf16[4,8,16], p1: s32[]) -> bf16[1,8,16] {
  ROOT %dynamic-slice.1 = bf16[1,8,16]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,8,16}
}

%sc (p0: bf16[4,8,16], p1: s32[1], p2: bf16[1,16]) -> bf16[4,8,16] {
  ROOT %scatter.1 = bf16[4,8,16]{2,1,0} scatter(%p0, %p1, %p2), to_apply=%add
}

ENTRY %main (cache: bf16[4,8,16], w: bf16[64,64], i: s32[]) -> bf16[8,16] {
  %slice_fusion = bf16[1,8,16]{2,1,0:T(8,128)(2,1)S(1)} fusion(%cache, %i), kind=kLoop, calls=%ds
  %scatter_fusion = bf16[4,8,16]{2,1,0:T(8,128)(2,1)S(1)} fusion(%cache, %idx, %upd), kind=kCustom, calls=%sc
  %copy-start = (bf16[64,64]{1,0}, bf16[64,64]{1,0:S(1)}, u32[]) copy-start(%w)
  %copy-done = bf16[64,64]{1,0:S(1)} copy-done(%copy-start)
  %pair = (f32[8]{0:S(1)}, f32[8]{0:S(1)}) fusion(%slice_fusion), kind=kOutput, calls=%ds
  %dot = bf16[8,16]{1,0:T(8,128)(2,1)S(1)} fusion(%slice_fusion, %copy-done), kind=kOutput, calls=%mm
  %moved = bf16[8,16]{1,0:T(8,128)(2,1)S(1)} copy(%dot)
  ROOT %out = bf16[8,16]{1,0} fusion(%moved, %scatter_fusion), kind=kLoop, calls=%mm
}
"""


def test_on_chip_copy_bytes_counts_synchronous_copies_into_vmem_and_their_reads():
    """The slice (1 x 8 x 16 bf16 = 256 bytes) written once and read by two fusions, the copy
    (256 bytes) written once and read once: 3 x 256 + 2 x 256. Not counted: the in-place
    scatter, the asynchronous prefetch, the tuple, the dot's result (a computation, not a
    copy), the HBM output; a CPU program has none."""
    assert plan_lib.on_chip_copy_bytes(ON_CHIP) == 3 * 256 + 2 * 256
    assert plan_lib.on_chip_copy_bytes(ON_CHIP.replace("S(1)", "S(0)")) == 0
    assert plan_lib.on_chip_copy_bytes(HLO) == 0


def test_executed_collectives_apply_trip_counts_dedupe_channels_and_name_axes():
    times, unknown = plan_lib.executions(LOOPS)
    assert unknown == 0
    assert times["main"] == 1 and times["body"] == 28 and times["inner"] == 28 * 4
    assert times["start"] == times["done"] == 28
    g = plan_lib.executed_collectives(LOOPS, {"data": 1, "fsdp": 8, "tensor": 2})
    # device ids: positions in the (data, fsdp, tensor) mesh; [2,8]<=[8,2]T(1,0) groups ids
    # 0, 2, 4, ... (fsdp); [8,2]<=[16] groups 0, 1 (tensor); the mesh[...] form's axis_0 of
    # the transposed ids is 0, 1 (tensor) as well
    assert g["fsdp"] == 28 * 8 * 64 * 2  # the split async gather, once per layer
    assert g["tensor"] == 28 * 4 * 4 * 8 * 4 + 16 * 4
    assert g["unknown loops"] == 0
    # the all-reduce in the 4-trip loop runs 28 x 4 times; the one inside the TPU's fused
    # all-reduce-scatter is a reduce-scatter, not counted
    r = plan_lib.executed_collectives(LOOPS, {"data": 1, "fsdp": 8, "tensor": 2}, "all-reduce")
    assert r == {"fsdp": 28 * 4 * 32 * 4, "unknown loops": 0}


def test_cpu8_plan_of_the_real_step_fsdp_x_tp():
    p = plan_lib.plan_run(_cfg(*FSDP_TP, "mesh.data=2"), "cpu:8")
    assert p.mesh == {"data": 2, "fsdp": 2, "tensor": 2} and p.num_devices == 8
    # the built-in model's matrices are split 4 ways; norms are replicated
    assert p.params_total_bytes / 4 <= p.params_bytes < p.params_total_bytes / 2
    # Adam's two moments, laid out like the params (plus a few step counters)
    assert 2 * p.params_bytes <= p.opt_bytes <= 2 * p.params_bytes + 64
    mem = p.memory
    assert mem.argument_bytes >= p.params_bytes + p.opt_bytes  # (jit drops unused batch fields)
    assert mem.temp_bytes > 0 and p.fits is None and p.hbm_bytes is None
    assert mem.collectives["all-gather"]["count"] > 0  # FSDP gathers the weights
    assert mem.collectives["all-reduce"]["count"] > 0  # the loss / estimator statistics
    assert not p.gathers_whole_model
    # the JAX sampler's prefill and decode step, on one of the 8 devices: 16 prompts, a cache
    # of max_context_tokens = 32 slots
    assert p.sampler is not None and p.sampler.dims["batch"] == 16
    assert p.sampler.decode.temp_bytes > 0 and p.sampler.params_bytes == p.params_total_bytes
    text = plan_lib.format_plan(p, "test")
    assert "mesh data=2 fsdp=2 tensor=2" in text and "all-gather" in text
    assert "verdict: compiled for 8 host devices" in text
    assert "JAX sampler: compiled for ONE cpu device" in text and "KV cache" in text
    assert "verdict: sampler: its " in text and "(16 prompts x 32 cache slots" in text
    # the analytic floor beside the compiled total: state, gradients, saved layer inputs, one
    # layer's working set and one chunk of logits
    floor = p.floor
    assert floor["train state"] >= p.state_bytes  # (+ step, rng, estimator state)
    assert floor["gradients"] == p.params_bytes and floor["new state"] == 0  # donated
    assert floor["total"] == sum(v for k, v in floor.items() if k != "total")
    assert 0 < p.floor_ratio == p.total_bytes / floor["total"]
    assert "analytic floor, per device" in text and "compiled total / floor = " in text
    assert "attention=blocked logits_chunk=512" in text
    assert "all-gathers executed in one step" in text and "FSDP: " in text
    # without remat the backward pass reuses the forward's gathered weights (saved with the
    # activations): one gather of each per micro-batch pass; with full remat one in the
    # forward and one in the backward pass. Not more: XLA hands one gathered copy of each
    # layer's weights to all its uses (sharding.layer_use_shardings)
    assert p.weights_gathered_bytes > 0
    assert 0.7 <= p.gathers_per_micro_batch <= 1.1, p.memory.gathers
    full = plan_lib.plan_run(_cfg(*FSDP_TP, "mesh.data=2", "trainer.remat=full"), "cpu:8",
                             sampler=False)
    assert 1.5 <= full.gathers_per_micro_batch <= 2.1, full.memory.gathers


def test_cpu_plan_with_prefix_trees_and_a_sharded_sampler():
    """prefix_sharing compiles the tree step with the tree extras at their largest (per device:
    3 int32 [rows, row_len] tree arrays, the [rows, row_len] index, the block ids); the
    sampler split data 2 x tensor 2 holds half the KV cache rows and half the KV heads."""
    plain = plan_lib.plan_run(_cfg(*FSDP_TP), "cpu:8", sampler=False)
    tree = plan_lib.plan_run(_cfg(*FSDP_TP, "trainer.prefix_sharing=true",
                                  "sampler.data_parallel=2", "sampler.tensor_parallel=2",
                                  "model.num_kv_heads=2"), "cpu:8")
    rows = tree.batch["num_rows"] // 2  # rows over data x fsdp = 2 shards
    blocks = 2 * tree.step["micro_batches"]
    assert tree.batch_bytes - plain.batch_bytes == 4 * (4 * rows * 32) + 4 * blocks // 2
    assert any("prefix trees at their largest" in n for n in tree.notes)
    sp = tree.sampler
    assert sp.mesh == {"data": 2, "tensor": 2} and sp.dims["batch"] == 16
    m = tree.model
    kv = 2 * m["layers"] * (16 // 2) * 32 * (2 // 2) * 32 * 4  # rows/2, heads/2, head_dim 32
    assert sp.kv_cache_bytes == kv + 4 * 8
    assert sp.params_bytes < sp.num_params * 4 * 0.75  # heads / MLP / vocab split 2 ways
    text = plan_lib.format_plan(tree)
    assert "JAX sampler: compiled for 4 cpu devices of one host" in text
    assert "collectives in the sampler's decode step" in text


def test_cli_plan_prints_the_table(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout: {tasks_per_step: 8, group_size: 2, max_turns: 2, "
                   "max_new_tokens: 8, max_context_tokens: 32}\n"
                   "trainer: {micro_batches: 1}\nmesh: {data: -1, fsdp: 1}\n")
    rc = cli.main(["plan", str(cfg), "--topology", "cpu:8"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "on cpu:8: 8 x cpu; mesh data=8 fsdp=1 tensor=1" in out
    assert "pure data parallelism" in out and "temporaries" in out


@pytest.mark.parametrize("args, words", [
    (["--topology", "v9x:2x2"], "unknown topology 'v9x:2x2'"),
    (["--topology", "cpu:eight"], "expected cpu:N"),
    (["--topology", "cpu:8", "--set", "mesh.data=-1", "--set", "mesh.fsdp=3"],
     "do not divide the 8 devices"),
    (["--topology", "cpu:8", "--set", "mesh.data=1", "--set", "mesh.tensor=8"],
     "mesh.tensor (8) must divide model.num_kv_heads"),
    (["--topology", "cpu:8", "--hf-config", "qwen2.5-0.5b", "--set", "mesh.data=1", "--set",
      "mesh.tensor=4"], "mesh.tensor=4 must divide the model's attention heads (14)"),
    (["--topology", "cpu:8", "--hf-config", "no/such/folder"], "no model config"),
    (["--topology", "cpu:8", "--set", "trainer.attention=splash"], "splash is a TPU kernel"),
])
def test_user_mistakes_exit_2_with_one_line(capsys, args, words):
    rc = cli.main(["plan", *args, "--set", "rollout.max_context_tokens=32"])
    err = capsys.readouterr().err
    assert rc == 2
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_missing_libtpu_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setattr(plan_lib.topology, "libtpu_available", lambda: False)
    rc = cli.main(["plan", "--topology", "v5e:2x2"])
    err = capsys.readouterr().err
    assert rc == 2 and 'pip install -e ".[tpu-aot]"' in err and "Traceback" not in err


def test_verdicts_name_the_key_to_change():
    gib = 2 ** 30
    base = dict(topology="v5e:2x2", chip="v5e", num_devices=4, num_hosts=1,
                device_kind="TPU v5 lite", mesh={"data": 1, "fsdp": 2, "tensor": 2},
                model={}, batch={}, step={"remat": False}, params_bytes=gib,
                params_total_bytes=4 * gib, opt_bytes=2 * gib, ref_bytes=0, batch_bytes=0,
                memory=plan_lib.CompiledMemory(3 * gib, 3 * gib, 0, 20 * gib, 0, 1.0),
                notes=[], hbm_bytes=16 * gib)
    v = plan_lib.Plan(**base).verdicts()
    assert v[0].startswith("DOES NOT FIT") and "trainer.remat" in v[0]
    big = plan_lib.Plan(**{**base, "params_bytes": 4 * gib, "opt_bytes": 8 * gib}).verdicts()
    assert any("whole model" in x and "mesh.fsdp" in x for x in big)
    assert any("DOES NOT FIT" in x and "raise mesh.fsdp" in x for x in big)
    ok = plan_lib.Plan(**{**base, "memory": plan_lib.CompiledMemory(3 * gib, 3 * gib, 0, gib,
                                                                    0, 1.0)}).verdicts()
    assert ok == ["fits: 7.00 GiB of 16 GiB HBM per v5e chip (44%)"]


@needs_libtpu
def test_tpu_v5e_2x2_default_step_and_qwen_policy_value(keep_env):
    """The default train step and a small Qwen3-shaped policy + value head step (gae reads the
    value head) compile for a v5e 2x2 slice in the FSDP x TP layout; the compiled arguments
    hold at least the sharded parameters and Adam state, and the total stays within a bound
    from the parameter count plus the activations of these small shapes."""
    p = plan_lib.plan_run(_cfg(*FSDP_TP), "v5e:2x2", sampler=False)
    assert p.device_kind == "TPU v5 lite" and p.num_devices == 4 and p.fits
    assert p.memory.collectives["all-gather"]["count"] > 0  # FSDP gathers weights ...
    assert p.memory.collectives["reduce-scatter"]["count"] > 0  # ... and scatters gradients
    q = plan_lib.plan_run(_cfg(*FSDP_TP, "estimator.name=gae", "model.value_head=true",
                               "model.dtype=bfloat16", "model.vocab_size=4096",
                               "model.hidden_size=256", "model.intermediate_size=512",
                               "model.num_layers=2", "model.num_heads=4",
                               "model.num_kv_heads=2", "model.head_dim=64"), "v5e:2x2",
                          sampler=False)
    assert q.model["value_head"] and q.model["dtype"] == "bfloat16"
    state = q.params_bytes + q.opt_bytes
    assert q.memory.argument_bytes >= state
    # params are split over fsdp x tensor = 4: a device holds at most ~1/4 + replicated norms
    assert q.params_bytes <= q.params_total_bytes / 4 * 1.1
    assert q.total_bytes < 8 * q.params_total_bytes + 64 * 2 ** 20
    assert q.fits and not q.gathers_whole_model


@needs_libtpu
def test_topology_libtpu_does_not_know_exits_2(capsys, keep_env):
    rc = cli.main(["plan", "--topology", "v5e:3x7"])
    err = capsys.readouterr().err
    assert rc == 2 and "libtpu does not know the topology 'v5e:3x7'" in err
    assert "Traceback" not in err


@needs_libtpu
def test_cli_plan_on_tpu_prints_hbm_verdict(capsys, keep_env):
    sets = [arg for s in SMALL + FSDP_TP for arg in ("--set", s)]
    rc = cli.main(["plan", "--topology", "v5e:2x2", *sets])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "4 x TPU v5 lite" in out and "HBM 16 GiB per v5e chip" in out
    assert "verdict: fits" in out
    assert "JAX sampler: compiled for ONE TPU v5 lite device" in out
    assert "verdict: sampler fits" in out


def test_model_shapes_without_weights(tmp_path):
    """The shipped TPU config names a checkpoint that is not here: its published shapes are
    used (and said); a config.json alone is enough; an unknown missing folder is a PlanError."""
    cfg = run_checks.load("configs/tpu_example.yaml", [], validate=False)
    notes = []
    mc = plan_lib.model_config(cfg, None, notes)
    assert (mc.hidden_size, mc.num_layers, mc.vocab_size) == (1536, 28, 151936)
    assert mc.dtype == "bfloat16" and "qwen2.5-1.5b" in notes[0]
    folder = tmp_path / "MyModel"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"head_dim": 16, "vocab_size": 300}')
    assert plan_lib.model_config(cfg, str(folder)).family == "qwen3"
    missing = run_checks.load("configs/tpu_example.yaml", ["model.hf_path=/nowhere/MyModel"],
                              validate=False)
    with pytest.raises(plan_lib.PlanError, match="needs only config.json"):
        plan_lib.model_config(missing)


@needs_libtpu
def test_multihost_slice_must_use_every_chip(capsys, keep_env):
    rc = cli.main(["plan", "--topology", "v5e:2x4", "--set", "mesh.data=1", "--set",
                   "mesh.fsdp=2"])
    err = capsys.readouterr().err
    assert rc == 2 and "8 chips on 2 hosts; a multi-host run must use them all" in err


# ----------------------------------------------------------------------------- the JAX sampler

# a bfloat16 Qwen3-shaped model whose KV heads differ from its attention heads
BF16 = ["model.dtype=bfloat16", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16"]


def _sampler_plan(cfg, topology, **kw):
    """``plan_sampler`` alone (no train step) for the config's model on the topology's first
    host (one device unless sampler.data_parallel / tensor_parallel say otherwise)."""
    cfg = run_checks.validate(cfg)
    devices = plan_lib.topology_devices(topology)
    model = nnx.eval_shape(lambda: Transformer(plan_lib.model_config(cfg), rngs=nnx.Rngs(0)))
    return plan_lib.plan_sampler(plan_lib.abstract_sampler(cfg, model, devices), cfg, **kw)


def _check_sampler_bytes(sp, cfg):
    """The KV cache is 2 x layers x kv_heads x head_dim x cache_len x batch x dtype bytes (plus
    an int32 index per row); the parameters are the parameter count x dtype bytes; the decode
    step's arguments hold both."""
    m, d = cfg.model, sp.dims
    itemsize = {"float32": 4, "bfloat16": 2}[m.dtype]
    kv = 2 * m.num_layers * m.num_kv_heads * m.head_dim * d["cache_len"] * d["batch"] * itemsize
    assert sp.kv_cache_bytes == kv + 4 * d["batch"]
    assert sp.params_bytes == sp.num_params * itemsize
    model = plan_lib.model_config(cfg)
    mlp = 3 * m.hidden_size * m.intermediate_size
    attn = m.hidden_size * m.head_dim * 2 * (m.num_heads + m.num_kv_heads)
    norms = 2 * m.hidden_size + 2 * m.head_dim  # per layer: two RMSNorms + q/k norms
    embed = (1 if model.tie_word_embeddings else 2) * model.vocab_size * m.hidden_size
    assert sp.num_params == embed + m.num_layers * (mlp + attn + norms) + m.hidden_size
    assert sp.decode.argument_bytes >= sp.params_bytes + sp.kv_cache_bytes
    assert sp.decode.temp_bytes > 0 and not sp.prefill.refused and not sp.decode.refused


def test_sampler_dims_follow_generate_buckets():
    """One host's largest call (train or eval) padded to a batch bucket; prompts of up to
    max_context - max_new tokens to a length bucket; the cache as generate sizes it."""
    fake = types.SimpleNamespace(batch_buckets=(8, 64), len_buckets=(64, 128, 256, 300),
                                 new_token_buckets=(16, 32, 64, 128, 256, 300), max_len=300)
    cfg = run_checks.load(None, ["rollout.tasks_per_step=6", "rollout.group_size=5",
                                 "rollout.max_context_tokens=300", "rollout.max_new_tokens=20",
                                 "trainer.eval_tasks=40"], validate=False)
    d = plan_lib.sampler_dims(cfg, fake)
    assert d == {"prompts": 40, "call": "eval", "batch": 64, "prompt_len": 300,
                 "new_tokens": 32, "cache_len": 300, "stop_ids": 4, "hosts": 1,
                 "prefill_chunk": None}
    # two hosts: each sends its share, 3 tasks x 5 = 15 rollouts or 20 eval tasks
    assert plan_lib.sampler_dims(cfg, fake, 2)["prompts"] == 20
    no_eval = run_checks.load(None, ["rollout.tasks_per_step=6", "rollout.group_size=5",
                                     "rollout.max_context_tokens=200", "trainer.eval_every=0",
                                     "rollout.branch_turns=[1]", "rollout.branch_factor=3"],
                              validate=False)
    d = plan_lib.sampler_dims(no_eval, fake)
    # 6 x 5 x 3 = 90 prompts: generate chunks them by the largest bucket (64)
    assert (d["prompts"], d["call"], d["batch"]) == (90, "train", 64)
    assert (d["prompt_len"], d["new_tokens"], d["cache_len"]) == (256, 16, 272)
    assert build.sampler_batch_buckets(no_eval) == (128, 256)
    # per host: 3 of the 6 tasks x 5 x 3 = 45 prompts; eval 64 of the 128 tasks
    assert build.sampler_batch_buckets(no_eval, 2) == (64, 128)


@pytest.mark.parametrize("sets", [[], BF16], ids=["float32", "bfloat16"])
def test_cpu_sampler_decode_step_bytes(sets):
    """The JAX sampler's own prefill and decode step compiled for one CPU device: 16 prompts
    (8 tasks x 2) in a batch of 16, a 32-slot cache (max_context_tokens)."""
    cfg = _cfg(*sets)
    sp = _sampler_plan(cfg, "cpu:1")
    assert sp.device_kind == "cpu"
    assert {k: sp.dims[k] for k in ("prompts", "batch", "prompt_len", "cache_len")} == \
        {"prompts": 16, "batch": 16, "prompt_len": 32, "cache_len": 32}
    _check_sampler_bytes(sp, run_checks.validate(cfg))
    # the prefill returns the cache and the logits [B, V] float32
    assert sp.prefill.output_bytes >= sp.kv_cache_bytes + 16 * cfg.model.vocab_size * 4


def test_cpu_sampler_sized_to_a_budget_and_its_decode_step():
    """With a budget below the whole call's peak (its programs plus the kept caches beside
    it) the plan sizes the call as a run does: the first size tried is the whole call, the
    plan is of the size chosen, within the budget. One decode step compiled alone reads at
    least every weight and the KV cache (at most 100% of the roofline)."""
    from jaxrl_agent.train.plan.report import format_decode_step
    cfg = _cfg(*BF16)
    whole = _sampler_plan(cfg, "cpu:1")
    assert whole.sized is None and whole.kept_bytes > 0
    assert whole.step_bytes >= whole.floor_step_bytes and 0 < whole.roofline_fraction <= 1
    assert whole.step_seconds is None  # no bandwidth to predict with on CPU
    sized = _sampler_plan(cfg, "cpu:1", budget=whole.peak_bytes - 1, bandwidth=1e12)
    z = sized.sized
    assert z["tried"][0] == (16, 2, whole.peak_bytes)
    assert z["rows"] is not None and sized.dims["batch"] == z["rows"]
    assert sized.peak_bytes <= whole.peak_bytes - 1
    assert (z["rows"], 0 if z["reuse_dropped"] else 2, sized.peak_bytes) in z["tried"]
    line = format_decode_step(sized)
    assert "of the roofline" in line[0] and "tokens/s per chip" in line[1]
    assert sized.tokens_per_s_per_chip == pytest.approx(z["rows"] * 1e12 / sized.step_bytes)


def test_sampler_verdicts_name_the_key_to_change():
    gib = 2 ** 30
    step = dict(topology="v5e:2x2", chip="v5e", num_devices=4, num_hosts=1,
                device_kind="TPU v5 lite", mesh={"data": 1, "fsdp": 2, "tensor": 2}, model={},
                batch={}, step={"remat": True}, params_bytes=gib, params_total_bytes=4 * gib,
                opt_bytes=2 * gib, ref_bytes=0, batch_bytes=0,
                memory=plan_lib.CompiledMemory(3 * gib, 3 * gib, 0, gib, 0, 1.0), notes=[],
                hbm_bytes=16 * gib)

    def mem(total):
        return plan_lib.CompiledMemory(total, 0, 0, 0, 0, 1.0)

    def sampler(decode_gib):
        return plan_lib.SamplerPlan(
            device_kind="TPU v5 lite", mesh={"data": 1, "tensor": 1},
            dims={"batch": 512, "cache_len": 4096}, num_params=1,
            params_bytes=2 * gib, kv_cache_bytes=gib, prefill=mem(3 * gib),
            decode=mem(decode_gib * gib))

    v = plan_lib.Plan(**step, sampler=sampler(20)).verdicts()
    assert v[0].startswith("fits:")  # the train step alone
    assert v[1].startswith("sampler DOES NOT FIT: its decode step needs 20.00 GiB")
    assert "rollout.max_context_tokens" in v[1] and "512 prompts x 4096 cache slots" in v[1]
    # 14 GiB of sampling + 3 GiB of train state on the same chip
    near = plan_lib.Plan(**step, sampler=sampler(14))
    assert near.sampler_device_bytes == 17 * gib and near.fits and near.run_fits is False
    assert near.verdicts()[1].startswith("sampler DOES NOT FIT beside the train state: 17.00")
    # the step (7 GiB) fits alone but not beside the sampler's weights (10 GiB here)
    heavy = plan_lib.Plan(**step, sampler=dataclasses.replace(sampler(4), params_bytes=10 * gib))
    assert heavy.run_fits is False and "train step 7.00 + sampler weights 10.00" in \
        heavy.verdicts()[1]
    # freed during the step (no asynchronous rollouts): only the step's own peak counts
    freed = dataclasses.replace(heavy, sampler_released=True)
    assert freed.sampler_device_bytes == 7 * gib and freed.run_fits
    # a train step that does not fit (its own verdict) and a sampler that fits beside the state
    big_step = dict(step, memory=plan_lib.CompiledMemory(3 * gib, 3 * gib, 0, 20 * gib, 0, 1.0))
    v = plan_lib.Plan(**big_step, sampler=sampler(4)).verdicts()
    assert v[0].startswith("DOES NOT FIT") and v[1] == (
        "sampler fits beside the train state: 7.00 GiB of 16 GiB HBM on its v5e chip "
        "(sampling 4.00 + train state 3.00); the train step itself does not fit (above)")
    ok = plan_lib.Plan(**step, sampler=sampler(4))
    assert ok.run_fits and ok.verdicts()[1] == \
        "sampler fits: 9.00 GiB of 16 GiB HBM on its v5e chip with the train state (56%)"


@needs_libtpu
def test_tpu_v5e_2x2_sampler_decode_step(keep_env):
    """The sampler's prefill and decode step compiled for one chip of a v5e 2x2 slice (bfloat16,
    2 KV heads): the logical KV cache and parameters match the model's shapes; the compiled
    arguments hold at least both (TPU layouts pad small minor dimensions)."""
    cfg = _cfg(*BF16)
    sp = _sampler_plan(cfg, "v5e:2x2")
    assert sp.device_kind == "TPU v5 lite"
    _check_sampler_bytes(sp, run_checks.validate(cfg))
    assert sp.peak_bytes < 64 * 2 ** 20
    # split over the slice's 4 chips (rows over 2, heads over 2): a quarter of the KV cache
    # per chip (plus its rows' int32 indices), less than the whole model, and the decode
    # step's Megatron all-reduces
    split = _sampler_plan(_cfg(*BF16, "sampler.data_parallel=2", "sampler.tensor_parallel=2"),
                          "v5e:2x2")
    assert split.mesh == {"data": 2, "tensor": 2}
    assert split.kv_cache_bytes == (sp.kv_cache_bytes - 4 * 16) // 4 + 4 * 8
    assert split.params_bytes < sp.params_bytes
    assert split.decode.collectives["all-reduce"]["count"] > 0 and not split.decode.refused


def test_fit_searches_the_fewest_micro_batches(monkeypatch):
    """--fit micro_batches bisects over the counts the config accepts (divisors of the
    trajectories per step, from the config's own up), one compile each, and plans the fewest
    that fits with the sampler; none fitting is a None plan; cpu:N has no HBM to fit."""
    gib = 2 ** 30
    calls = []

    def fake_plan(cfg, topology, *, hf_config=None, sampler=True):
        m = cfg.trainer.micro_batches
        calls.append((m, sampler))
        total = (4 + 32 / m) * gib  # 16 trajectories: fits (<= 16 GiB) from 4 micro-batches
        return types.SimpleNamespace(total_bytes=total, fits=total <= 16 * gib,
                                     memory=types.SimpleNamespace(compile_s=1.0),
                                     step={"micro_batches": m})

    monkeypatch.setattr(plan_lib.run, "plan_run", fake_plan)
    cfg = _cfg("trainer.micro_batches=1")  # 8 tasks x 2 = 16 trajectories: 1, 2, 4, 8, 16
    p, tried = plan_lib.fit_micro_batches(cfg, "v5e:2x2", log=lambda line: None)
    assert p.step["micro_batches"] == 4 and calls[-1] == (4, True)
    assert [t[0] for t in tried] == [4, 1, 2] and [t[2] for t in tried] == [True, False, False]
    monkeypatch.setattr(plan_lib.run, "plan_run", lambda *a, **k: types.SimpleNamespace(
        total_bytes=99 * gib, fits=False, memory=types.SimpleNamespace(compile_s=1.0)))
    p, tried = plan_lib.fit_micro_batches(cfg, "v5e:2x2", log=lambda line: None)
    assert p is None and tried[-1][0] == 16
    monkeypatch.setattr(plan_lib.run, "plan_run", lambda *a, **k: types.SimpleNamespace(
        total_bytes=gib, fits=None, memory=types.SimpleNamespace(compile_s=1.0)))
    with pytest.raises(plan_lib.PlanError, match="--fit needs a TPU topology"):
        plan_lib.fit_micro_batches(cfg, "cpu:8", log=lambda line: None)
