"""Run configuration: YAML files in configs/, overrides, structural and semantic errors, round trips."""

import dataclasses
import pathlib

import pytest
import yaml

from jaxrl_agent import config as C
from jaxrl_agent import run_checks
from jaxrl_agent import estimators

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
ALL_YAML = sorted(CONFIGS.glob("*.yaml"))
VALID_YAML = ALL_YAML


def test_config_dir_has_the_expected_files():
    names = {p.name for p in ALL_YAML}
    assert {"cpu_default.yaml", "gridworld_grpo.yaml", "gridworld_gigpo.yaml", "gpu_example.yaml",
            "tpu_example.yaml"} <= names


@pytest.mark.parametrize("path", VALID_YAML, ids=lambda p: p.name)
def test_every_yaml_loads_and_validates(path):
    cfg = run_checks.load(path)
    assert isinstance(cfg, C.RunConfig)
    assert run_checks.validate(cfg) is cfg
    assert cfg.name in C.describe(cfg)


def test_critic_estimator_needs_a_value_head():
    with pytest.raises(C.ConfigError, match="model.value_head: true"):
        run_checks.load(None, ["estimator.name=turn_gae"])
    run_checks.load(None, ["estimator.name=hae", "model.value_head=true"])


def test_estimator_extras_the_loop_cannot_supply_are_refused_early():
    with pytest.raises(C.ConfigError, match="turn_keys"):
        run_checks.load(None, ["estimator.name=step_group", "estimator.params={key: turn_key}"])
    run_checks.load(None, ["estimator.name=step_group", "estimator.params={key: history}"])


def test_grpo_and_gigpo_configs_differ_only_in_estimator_and_name():
    a = C.to_dict(run_checks.load(CONFIGS / "gridworld_grpo.yaml"))
    b = C.to_dict(run_checks.load(CONFIGS / "gridworld_gigpo.yaml"))
    for d in (a, b):
        del d["estimator"], d["name"]
    assert a == b


def test_cpu_default_yaml_equals_dataclass_defaults():
    assert run_checks.load(None) == C.RunConfig() == run_checks.load(CONFIGS / "cpu_default.yaml")


def test_hf_examples_validate_without_checkpoint_on_disk():
    for name in ("gpu_example.yaml", "tpu_example.yaml"):
        cfg = run_checks.load(CONFIGS / name)
        assert cfg.model.hf_path and cfg.model.dtype == "bfloat16"
        with pytest.raises(C.ConfigError, match="does not exist"):
            C.check_paths(cfg)
    C.check_paths(C.RunConfig())  # no hf_path: nothing to check


def test_tpu_mesh_resolves():
    cfg = run_checks.load(CONFIGS / "tpu_example.yaml")
    assert C.check_mesh(cfg, 16) == (2, 4, 2)
    with pytest.raises(C.ConfigError, match="do not divide"):
        C.check_mesh(cfg, 12)
    assert C.check_mesh(C.RunConfig(), 8) == (8, 1, 1)
    fixed = run_checks.from_dict({"mesh": {"data": 2, "fsdp": 2, "tensor": 1}})
    assert C.check_mesh(fixed, 4) == (2, 2, 1)
    assert C.check_mesh(fixed, 8) == (2, 2, 1)  # a smaller mesh: the first 4 devices
    with pytest.raises(C.ConfigError, match="only 2 devices"):
        C.check_mesh(fixed, 2)


# --- overrides ---------------------------------------------------------------------------------


def test_scalar_overrides():
    cfg = run_checks.load(None, ["trainer.steps=5", "optimizer.lr=1e-5", "model.value_head=true",
                        "name=exp1", "model.hf_path=null", "rollout.temperature=0"])
    assert cfg.trainer.steps == 5
    assert cfg.optimizer.lr == 1e-5 and isinstance(cfg.optimizer.lr, float)  # YAML 1.1 string
    assert cfg.model.value_head is True
    assert cfg.name == "exp1" and cfg.model.hf_path is None
    assert cfg.rollout.temperature == 0.0 and isinstance(cfg.rollout.temperature, float)


def test_nested_dict_overrides():
    cfg = run_checks.load(CONFIGS / "gridworld_grpo.yaml",
                 ["estimator.params.eps=1e-8", "env.kwargs.size=7", "loss.params.clip_high=0.3"])
    assert cfg.estimator.params == {"eps": 1e-8, "ddof": 1}  # 1e-8 is a float, not YAML 1.1's str
    assert cfg.env.kwargs == {"size": 7, "max_turns": 12}
    assert cfg.loss.params == {"clip_high": 0.3}
    cfg = run_checks.load(None, ["estimator.name=gae", "estimator.params.gamma=0.99",
                        "estimator.params.lam=0.95", "model.value_head=true"])
    assert cfg.estimator.params == {"gamma": 0.99, "lam": 0.95}


def test_mapping_key_override_merges_into_the_defaults(tmp_path):
    """``--set env.kwargs.k=v`` sets one key: the other keys of the mapping stay, whether they
    come from the built-in defaults or from the YAML file (a whole-mapping value replaces)."""
    default_kwargs = C.RunConfig().env.kwargs
    assert default_kwargs  # the test needs a non-empty default mapping
    cfg = run_checks.load(None, ["env.kwargs.invalid_penalty=0"])
    assert cfg.env.kwargs == {**default_kwargs, "invalid_penalty": 0}
    path = tmp_path / "c.yaml"
    path.write_text("env:\n  name: gridworld\n  kwargs: {size: 6}\n")
    assert run_checks.load(path, ["env.kwargs.extra_walls=1"]).env.kwargs == {"size": 6, "extra_walls": 1}
    path.write_text("env:\n  name: gridworld\n")  # kwargs left out: the default, then merged
    assert run_checks.load(path, ["env.kwargs.size=6"]).env.kwargs == {**default_kwargs, "size": 6}
    assert run_checks.load(None, ["env.kwargs={size: 6}"]).env.kwargs == {"size": 6}


def test_list_and_mapping_overrides():
    cfg = run_checks.load(None, ["env.kwargs={size: 4, extra_walls: 0}", "estimator.params={eps: 0.5}",
                        "estimator.name=grpo"])
    assert cfg.env.kwargs == {"size": 4, "extra_walls": 0}
    assert cfg.estimator.params == {"eps": 0.5}
    d = C.apply_overrides({}, ["env.kwargs.layout=[1, 2, 3]"])
    assert d == {"env": {"kwargs": {"layout": [1, 2, 3]}}}
    cfg = run_checks.from_dict(d)  # structurally fine; env kwargs checked by validate
    assert cfg.env.kwargs["layout"] == [1, 2, 3]
    with pytest.raises(C.ConfigError, match=r"unknown key 'env.kwargs.layout'.*valid keys: size"):
        run_checks.validate(cfg)


def test_overrides_apply_in_order_and_do_not_mutate_input():
    raw = {"trainer": {"steps": 3}}
    out = C.apply_overrides(raw, ["trainer.steps=4", "trainer.steps=6"])
    assert out["trainer"]["steps"] == 6 and raw == {"trainer": {"steps": 3}}


@pytest.mark.parametrize("bad", ["trainer.steps", "=3", "trainer..steps=3", "a.b=[unclosed"])
def test_malformed_overrides(bad):
    with pytest.raises(C.ConfigError, match="override"):
        run_checks.load(None, [bad])


def test_override_through_scalar_is_an_error():
    with pytest.raises(C.ConfigError, match="'trainer.steps' is not a mapping"):
        C.apply_overrides({"trainer": {"steps": 3}}, ["trainer.steps.x=1"])
    with pytest.raises(C.ConfigError, match="'trainer.steps' is not a mapping"):
        run_checks.load(None, ["trainer.steps.x=1"])  # the default steps value is on the way


# --- structural errors -------------------------------------------------------------------------


def test_unknown_key_lists_valid_keys():
    with pytest.raises(C.ConfigError) as e:
        run_checks.load(None, ["trainer.lrr=1e-5"])
    msg = str(e.value)
    assert "unknown key 'trainer.lrr'" in msg and "valid keys of trainer:" in msg
    for f in dataclasses.fields(C.TrainerSection):
        assert f.name in msg


def test_unknown_key_suggests_other_section():
    with pytest.raises(C.ConfigError, match=r"unknown key 'trainer.lr'.*did you mean optimizer.lr"):
        run_checks.load(None, ["trainer.lr=1e-5"])


def test_unknown_top_level_key():
    with pytest.raises(C.ConfigError, match=r"unknown key 'trainr'; valid top-level keys: name, imports, run, model"):
        run_checks.from_dict({"trainr": {}})


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  group_sizee: 4\n")
    with pytest.raises(C.ConfigError, match=r"unknown key 'rollout.group_sizee'.*group_size"):
        run_checks.load(p)


@pytest.mark.parametrize("d, key, expected", [
    ({"trainer": {"steps": "ten"}}, "trainer.steps", "int"),
    ({"trainer": {"steps": 2.5}}, "trainer.steps", "int"),
    ({"trainer": {"steps": True}}, "trainer.steps", "int"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr", "float"),
    ({"optimizer": {"lr": True}}, "optimizer.lr", "float"),
    ({"optimizer": {"lr": "1e-5"}}, "optimizer.lr", "float"),  # quoted: a str, not a float
    ({"model": {"value_head": "yes please"}}, "model.value_head", "bool"),
    ({"model": {"value_head": 1}}, "model.value_head", "bool"),
    ({"model": {"hf_path": 3}}, "model.hf_path", "str | null"),
    ({"estimator": {"params": [1, 2]}}, "estimator.params", "dict"),
    ({"env": {"name": 5}}, "env.name", "str"),
    ({"trainer": 3}, "trainer", "mapping"),
])
def test_type_errors_name_key_type_and_value(d, key, expected):
    with pytest.raises(C.ConfigError) as e:
        run_checks.from_dict(d)
    msg = str(e.value)
    assert f"'{key}'" in msg and expected in msg
    value = d[key.split(".")[0]] if "." not in key else d[key.split(".")[0]][key.split(".")[1]]
    assert repr(value) in msg


def test_scientific_notation_is_float_everywhere(tmp_path):
    p = tmp_path / "sci.yaml"
    p.write_text("optimizer: {lr: 1e-5}\nestimator: {params: {eps: 1E-7}}\nname: 1e3run\n")
    cfg = run_checks.load(p)
    assert cfg.optimizer.lr == 1e-5 and cfg.estimator.params == {"eps": 1e-7}
    assert cfg.name == "1e3run"


def test_ints_accepted_for_floats():
    cfg = run_checks.from_dict({"optimizer": {"lr": 1, "grad_clip": 0}, "rollout": {"top_p": 1}})
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert isinstance(cfg.optimizer.grad_clip, float) and isinstance(cfg.rollout.top_p, float)


def test_empty_sections_and_files(tmp_path):
    assert run_checks.from_dict({"trainer": None, "env": {"kwargs": None}}) == C.RunConfig(
        env=C.EnvSection(kwargs={}))
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    assert run_checks.load(p) == C.RunConfig()
    p.write_text("- a\n- b\n")
    with pytest.raises(C.ConfigError, match="top level must be a mapping"):
        run_checks.load(p)


# --- semantic errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("override, match", [
    ("estimator.name=nope", r"unknown estimator 'nope' \(known: bipace, ccpo"),
    ("estimator.params.gama=0.9", r"unknown key 'estimator.params.gama' for estimator 'gigpo'; "
                                  r"valid keys: gamma, step_weight"),
    ("loss.policy=ppo2", r"unknown policy loss 'ppo2'; known: ppo, gspo"),
    ("loss.params.clip=0.2", r"unknown key 'loss.params.clip' for loss 'ppo'.*clip_low"),
    ("loss.agg=mean", r"loss.agg must be one of token_mean"),
    ("loss.kl_estimator=k4", r"loss.kl_estimator must be one of k1"),
    ("loss.kl_coef=-1", r"loss.kl_coef must be >= 0"),
    ("env.name=maze", r"unknown environment 'maze'; known: calculator, chain, gridworld"),
    ("env.kwargs.sise=5", r"unknown key 'env.kwargs.sise' for environment 'gridworld'.*size"),
    ("rollout.group_size=0", r"rollout.group_size must be > 0"),
    ("rollout.tasks_per_step=-2", r"rollout.tasks_per_step must be > 0"),
    ("rollout.max_turns=0", r"rollout.max_turns must be > 0"),
    ("rollout.temperature=-0.1", r"rollout.temperature must be >= 0"),
    ("rollout.top_p=0", r"rollout.top_p must be in \(0, 1\]"),
    ("rollout.top_p=1.5", r"rollout.top_p must be in \(0, 1\]"),
    ("rollout.top_k=-1", r"rollout.top_k must be >= 0"),
    ("rollout.max_new_tokens=600", r"max_new_tokens \(600\) must be < rollout.max_context_tokens"),
    ("rollout.on_invalid=ignore", r"rollout.on_invalid must be one of penalise, fail"),
    ("rollout.branch_turns=[12]", r"rollout.branch_turns must be distinct ints in "
                                  r"\[0, rollout.max_turns\) = \[0, 12\); got \[12\]"),
    ("rollout.branch_turns=[1, 1]", r"rollout.branch_turns must be distinct ints"),
    ("rollout.branch_turns=[-1]", r"rollout.branch_turns must be distinct ints"),
    ("rollout.branch_turns=[a]", r"rollout.branch_turns must be distinct ints"),
    ("rollout.branch_factor=0", r"rollout.branch_factor must be >= 1"),
    ("model.dtype=float16", r"model.dtype must be one of float32, bfloat16"),
    ("model.num_kv_heads=3", r"num_heads \(4\) must be a multiple of model.num_kv_heads \(3\)"),
    ("model.vocab_size=100", r"model.vocab_size must be >= 260"),
    ("model.value_stop_gradient=true", r"needs model.value_head"),
    ("optimizer.lr=0", r"optimizer.lr must be > 0"),
    ("optimizer.lr=.nan", r"optimizer.lr must be > 0"),
    ("optimizer.decay=linear", r"optimizer.decay must be one of cosine, constant"),
    ("optimizer.b2=1", r"optimizer.b2 must be in \[0, 1\)"),
    ("trainer.layout=flat", r"trainer.layout must be one of concatenated, per_step"),
    ("trainer.steps=0", r"trainer.steps must be > 0"),
    ("trainer.micro_batches=3", r"micro_batches \(3\) must divide .* = 64"),
    ("trainer.mini_batches=3", r"mini_batches \(3\) must divide rollout.tasks_per_step"),
    ("trainer.ppo_epochs=0", r"trainer.ppo_epochs must be > 0"),
    ("trainer.sft_noise=1.5", r"trainer.sft_noise must be in \[0, 1\]"),
    ("trainer.max_policy_lag=-1", r"trainer.max_policy_lag must be >= 0"),
    ("trainer.prefix_tree_len=-1", r"trainer.prefix_tree_len must be >= 0"),
    ("trainer.remat=sometimes", r"trainer.remat must be one of none, full, save_dots, offload"),
    ("trainer.attention=sparse", r"trainer.attention must be one of dense, blocked"),
    ("trainer.logits_chunk=0", r"trainer.logits_chunk must be > 0"),
    ("checkpoint.keep=-1", r"checkpoint.keep must be >= 0"),
    ("mesh.fsdp=0", r"mesh.fsdp must be >= 1 or -1"),
    ("mesh.tensor=-1", r"at most one mesh axis may be -1"),
    ("mesh.tensor=3", r"mesh.tensor \(3\) must divide model.num_kv_heads \(4\)"),
    ("name=''", r"name must be a non-empty directory name"),
    ("name=a/b", r"name must be a non-empty directory name"),
    ("sampler.name=sglang", r"sampler.name must be one of jax, vllm"),
    ("sampler.dtype=float64", r"sampler.dtype must be one of"),
    ("sampler.transfer=nccl", r"sampler.transfer must be one of auto, host, dlpack"),
    ("sampler.max_num_seqs=0", r"sampler.max_num_seqs must be > 0"),
    ("sampler.probe_every=-1", r"sampler.probe_every must be >= 0"),
    ("sampler.probe_tol=0", r"sampler.probe_tol must be > 0"),
    ("sampler.gpu_memory_utilization=1.5", r"sampler.gpu_memory_utilization must be in"),
    ("sampler.data_parallel=0", r"sampler.data_parallel must be an int >= 1 or -1"),
    ("sampler.tensor_parallel=3", r"sampler.tensor_parallel \(3\) must divide model.num_heads"),
    ("sampler.prefill_chunk=-8", r"sampler.prefill_chunk must be >= 0"),
    ("sampler.reuse_calls=-1", r"sampler.reuse_calls must be >= 0"),
    ("loss.entropy_coef=.inf", r"loss.entropy_coef must be a finite number"),
])
def test_semantic_errors(override, match):
    cfg = run_checks.load(None, [override], validate=False)
    with pytest.raises(C.ConfigError, match=match):
        run_checks.validate(cfg)


def test_sampler_devices_are_the_jax_samplers():
    with pytest.raises(C.ConfigError, match="the vllm sampler runs one engine per host"):
        run_checks.validate(run_checks.load(None, ["sampler.name=vllm", "sampler.tensor_parallel=2"],
                          validate=False))
    with pytest.raises(C.ConfigError, match="at most one of data_parallel / tensor_parallel"):
        run_checks.validate(run_checks.load(None, ["sampler.data_parallel=-1", "sampler.tensor_parallel=-1"],
                          validate=False))
    cfg = run_checks.load(None, ["sampler.data_parallel=-1", "sampler.tensor_parallel=2"])
    assert "sampler   jax over data=-1 x tensor=2 devices" in C.describe(cfg)


def test_every_registered_estimator_and_its_params_validate():
    """Every estimator with its defaults validates on the default run (the grid world reports a
    potential, so pica trains), or is refused because it reads an input no source of that run
    supplies (the teacher's log-probs, multi-agent values), with the config key that would
    supply it named."""
    refused = []
    for name in estimators.names():
        params = dict(estimators.spec(name).hyper_params)
        cfg = run_checks.from_dict({"estimator": {"name": name, "params": params},
                           "model": {"value_head": True}})
        try:
            run_checks.validate(cfg)
        except C.ConfigError as e:
            assert "set teacher.source" in str(e) or "signals: [" in str(e), (name, str(e))
            refused.append(name)
    assert set(refused) == {"ccpo", "credit", "opd", "sharp"}


@pytest.mark.parametrize("sets,match", [
    (["estimator.name=grpo", "estimator.params.eps=abc"],
     r"estimator.params: estimator 'grpo': eps must be a finite "
                                   r"number \(default 1e-06\), got 'abc'"),
    (["estimator.name=grpo", "estimator.params.singleton=bogus"],
     r"estimator.params: singleton must be one of"),
    (["estimator.name=grpo", "estimator.params.eps=-1"], r"estimator.params: eps must be > 0"),
    (["estimator.name=grpo", "estimator.params.ddof=0.5"], r"ddof must be an integer"),
    (["estimator.then=[{name: reallocate, params: {seed: x}}]"],
     r"estimator.then\[0\]: transform 'reallocate': seed must be an integer"),
    (["loss.params.clip_low=abc"], r"loss.params.clip_low must be a finite number"),
    (["rollout.group_size=1", "estimator.name=grpo"],
     r"rollout.group_size = 1: estimator 'grpo' compares the rollouts"),
    (["rollout.group_size=1", "estimator.name=rloo"], r"estimator 'rloo' compares"),
    (["estimator.name=lambda_returns", "estimator.params.level=tok"],
     r"level must be one of"),
])
def test_hyper_parameter_values_are_checked_at_config_time(sets, match):
    with pytest.raises(C.ConfigError, match=match):
        run_checks.load(None, sets + ["model.value_head=true"])


def test_group_size_one_is_fine_for_estimators_with_their_own_baseline():
    for name in ("turn_gae", "reinforce_pp", "sapo"):
        run_checks.load(None, ["rollout.group_size=1", f"estimator.name={name}", "model.value_head=true"])


def test_config_error_is_value_error():
    assert issubclass(C.ConfigError, ValueError)


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.name)
def test_round_trip_to_dict_from_dict(path):
    cfg = run_checks.load(path, validate=False)
    d = C.to_dict(cfg)
    assert run_checks.from_dict(d) == cfg
    assert yaml.safe_load(yaml.safe_dump(d)) == d  # YAML-safe


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.name)
def test_round_trip_dump_load(path, tmp_path):
    cfg = run_checks.load(path, ["trainer.seed=7", "estimator.params.extra=[1, 2]"], validate=False)
    out = tmp_path / "dumped.yaml"
    C.dump_yaml(cfg, out)
    assert run_checks.load(out, validate=False) == cfg


def test_to_dict_is_a_copy():
    cfg = run_checks.load(None, ["env.kwargs.size=4"])
    d = C.to_dict(cfg)
    d["env"]["kwargs"]["size"] = 9
    assert cfg.env.kwargs["size"] == 4


def test_frozen():
    cfg = C.RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.steps = 3  # type: ignore[misc]


def test_describe_mentions_the_essentials():
    s = C.describe(run_checks.load(CONFIGS / "gridworld_grpo.yaml"))
    assert "gridworld_grpo" in s and "grpo" in s and "ppo" in s and "4 tasks x 8 = 32" in s
    assert "tiny built-in" in C.describe(C.RunConfig())


def test_sampler_shorthand():
    """``sampler: vllm`` (YAML or --set) is ``sampler: {name: vllm}``; the rest keep defaults."""
    cfg = run_checks.load(None, ["sampler=vllm"])
    assert cfg.sampler == C.SamplerSection(name="vllm")
    assert run_checks.from_dict({"sampler": "vllm"}).sampler.name == "vllm"
    assert run_checks.load(None, ["sampler.name=vllm", "sampler.probe_every=0"]).sampler.probe_every == 0
    assert run_checks.load(None, ["sampler=vllm", "sampler.kv_cache_mb=64"]).sampler == C.SamplerSection(
        name="vllm", kv_cache_mb=64)
    with pytest.raises(C.ConfigError, match="sampler"):
        run_checks.from_dict({"sampler": 3})
    # on a config with a sampler mapping, `--set sampler=jax` changes only the name
    gpu = run_checks.load(CONFIGS / "gpu_example.yaml", ["sampler=jax"], validate=False)
    assert gpu.sampler.name == "jax" and gpu.sampler.transfer == "dlpack"


@pytest.mark.parametrize("value, policy", [("true", "full"), ("false", "none"),
                                           ("save_dots", "save_dots"), ("full", "full")])
def test_remat_takes_a_policy_or_a_bool(value, policy):
    from jaxrl_agent.train.build import step_config

    cfg = run_checks.load(None, [f"trainer.remat={value}", "trainer.logits_chunk=64",
                        "trainer.attention=dense"])
    scfg = step_config(cfg, 1)
    assert (scfg.remat, scfg.logits_chunk, scfg.attention) == (policy, 64, "dense")


@pytest.mark.parametrize("sets", [[], ["trainer.steps=6"], ["trainer.steps=1"],
                                  ["optimizer.decay=constant"],
                                  ["optimizer.warmup_steps=0", "trainer.steps=4"],
                                  ["trainer.steps=12", "trainer.mini_batches=2",
                                   "rollout.tasks_per_step=4"]])
def test_the_banner_says_the_schedule_the_run_follows(sets):
    from jaxrl_agent.train.build import run_lr_schedule
    cfg = run_checks.load(None, sets)
    words = C._schedule_words(cfg)
    assert words in C.describe(cfg)
    lr = run_lr_schedule(cfg)
    steps, o = cfg.trainer.steps, cfg.optimizer
    last = lr(steps - 1) / o.lr
    if "% of lr at the last step" in words:
        assert f"{last:.0%} of lr at the last step" in words
    else:
        assert last == pytest.approx(1.0)
    warm = next((k for k in range(steps) if lr(k) >= o.lr * (1 - 1e-6)), steps)
    if "warm-up over" in words:
        assert f"warm-up over {warm} of {steps} steps" in words
        assert ("cut to the run" in words) == (warm < o.warmup_steps)
    else:
        assert warm == 0


@pytest.mark.parametrize("name", sorted(p.name for p in (
    pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")))
def test_resume_with_the_same_shipped_config_changes_nothing(name, tmp_path, monkeypatch):
    # `train CONFIG` then `train CONFIG --resume`, from another working directory: the values
    # the program fills in (the task file's folder, a text environment's estimator) are
    # resolved the same way both times
    from jaxrl_agent import cli
    from jaxrl_agent.train.rundir import write_config
    config = pathlib.Path(__file__).resolve().parents[1] / "configs" / name
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    sets = ["--set", f"run.dir={run}"]
    fresh = cli._train_config(cli.build_parser().parse_args(["train", str(config), *sets]))
    run.mkdir()
    write_config(fresh, str(run / "config.yaml"))
    resumed = cli._train_config(cli.build_parser().parse_args(
        ["train", str(config), *sets, "--resume"]))
    saved = run_checks.from_dict(C.read_yaml(run / "config.yaml"))
    assert C.config_changes(saved, resumed) == ([], [])


@pytest.mark.parametrize("name", ["tiny_chat_tasks.yaml"])
def test_shipped_configs_find_their_files_from_any_directory(name, tmp_path, monkeypatch):
    from jaxrl_agent import envs
    config = pathlib.Path(__file__).resolve().parents[1] / "configs" / name
    monkeypatch.chdir(tmp_path)  # neither the repository root nor configs/
    cfg = run_checks.load(str(config), validate=False)
    env = envs.make_env(cfg.env.name, **cfg.env.kwargs)
    assert env is not None


def test_the_schema_checks_its_own_values_and_the_run_checks_ask_the_package():
    """``config`` parses and checks each section's values and imports nothing of the package
    above it; ``run_checks.load`` adds the registries, the environments and the methods' trace,
    in the same order and with the same messages as one call did before the split."""
    import subprocess
    import sys
    probe = ("import sys, jaxrl_agent.config as c; c.load(None, ['trainer.steps=3']); "
             "print(sorted(m for m in sys.modules if m.startswith('jaxrl_agent')))")
    mods = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout
    for above in ("run_checks", "train", "estimators", "losses"):
        assert f"'jaxrl_agent.{above}" not in mods, mods
    unknown = ["estimator.name=no_such_method"]
    assert C.load(None, unknown).estimator.name == "no_such_method"  # a value, not the schema's
    with pytest.raises(C.ConfigError, match="estimator.name"):
        run_checks.load(None, unknown)
    # a section's own value is refused by both, with one message
    bad = ["optimizer.lr=-1"]
    with pytest.raises(C.ConfigError) as schema:
        C.load(None, bad)
    with pytest.raises(C.ConfigError) as full:
        run_checks.load(None, bad)
    assert str(schema.value) == str(full.value)
    # the order of the sections: the model's check comes before the estimator's
    with pytest.raises(C.ConfigError, match="model"):
        run_checks.load(None, unknown + ["model.dtype=float7"])
