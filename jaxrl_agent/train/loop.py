"""The training loop behind ``jaxrl-agent train``.

Per step ``s`` (all randomness is a function of ``(trainer.seed, s)``, so a resumed run repeats
an uninterrupted one exactly)::

    tasks    = env.sample_tasks(rng(seed, s), tasks_per_step, "train")
    records  = collect_groups(env, tasks, sampler @ policy version s, ...)   # G per task
    records  = run_signals(records, signals)   # judges / signal plug-ins (train.signals)
    records  = refuse_stale(records, version=s, max_lag)                    # whole groups
    batch    = pack(records, plan)             # one plan: num_shards = data*fsdp * mini_batches *
                                              # micro_batches, sizes fixed in per_step; with a
                                              # teacher-only context, the teacher's rows too
    state    = train_step(state, batch)       # ppo_epochs x mini_batches updates; version s + 1
    sampler.sync_weights(state.params, version=s + 1)
    log, evaluate (greedy, held-out "test" tasks), checkpoint

The loop's parts live beside it: the run directory (``train.rundir``), building the model,
sampler, step settings and optimizer from the config (``train.build``), the teacher
(``train.teacher``), signal plug-ins (``train.signals``), the inputs' sources
(``train.inputs``), and a step's samples as text (``train.samples``).

Before step 0 of a fresh run: the optional supervised warm-up on solver demonstrations, then a
held-out evaluation (step 0 of the learning curve).

Sharding: one ``(data, fsdp, tensor)`` mesh (``sharding.make_mesh``); the train state is laid
out by the partition rules (``mesh.rules``), the batch over ``data x fsdp``. With several
processes (``distributed:``), every process collects its share of the step's tasks (and eval
tasks) with its own sampler, the records are exchanged (``multihost.allgather_objects``: a few
MB of token ids), every process packs the same global batch and puts only its own shards on its
devices. Checkpoints are written by all processes together (orbax); metrics, plots, the
run-directory lock and exports belong to process 0.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import sys
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl_agent import config as config_lib
from jaxrl_agent import envs, run_checks
from jaxrl_agent import sharding
from jaxrl_agent.sharding import multihost
from jaxrl_agent.batch import bucket, round_up_to_step
from jaxrl_agent.rollout.records import pack, parse_records, plan_packing
from jaxrl_agent.rollout.collect import RolloutConfig, collect_groups
from jaxrl_agent.rollout.tree import attach_prefix_trees, attention_cost
from jaxrl_agent.rollout.workers import RolloutWorkers
from jaxrl_agent.sampling.jax_sampler import JaxSampler
from jaxrl_agent.train import call_size
from jaxrl_agent.train import sft as sft_lib
from jaxrl_agent.train.checkpoint import Checkpointer
from jaxrl_agent.train.inputs import attach_env_inputs
from jaxrl_agent.train.signals import SignalError, run_signals
from jaxrl_agent.train.build import (build_model, build_sampler, lora_fields, lora_summary,
                                     run_lr_schedule, run_optimizer, sampler_batch_buckets,
                                     step_config, step_paths)
from jaxrl_agent.train.rundir import (LORA_BASE, RunLockedError, existing_outputs,
                                      lock_run_dir, never_trained, run_config, write_config)
from jaxrl_agent.train.diagnostics import credit_metrics, episode_metrics, shuffled_outcomes
from jaxrl_agent.train.samples import (credit_trajectories, sample_conversations,
                                       samples_markdown, turn_credit)
from jaxrl_agent.train.teacher import load_teacher, teacher_records, teacher_summary
from jaxrl_agent.train.metrics import MetricsLogger, read_metrics
from jaxrl_agent.train.step import (TrainState, init_state, init_state_from_params,
                                    make_train_step, split_trainable, trainable_of)

__all__ = ["EnvFailureError", "StaleBatchError", "Summary", "Trainer", "evaluate_run",
           "RunPolicy", "load_run_policy", "refuse_stale", "staleness_metrics", "step_seed",
           "success_se"]


class StaleBatchError(ValueError):
    """Every trajectory of a step was sampled by a policy older than ``max_policy_lag``."""


class EnvFailureError(ValueError):
    """Every trajectory of ``trainer.max_failed_steps`` steps in a row ended in an environment
    (or reward function) error."""


def success_se(success: float, n: int) -> float:
    """Binomial standard error of a success rate measured on ``n`` independent episodes:
    ``sqrt(p (1 - p) / n)`` (0 for ``n = 0``)."""
    return math.sqrt(max(success * (1.0 - success), 0.0) / n) if n > 0 else 0.0


def step_seed(seed: int, step: int, what: str) -> int:
    """A 63-bit seed for one purpose at one step (stable across processes and resumes)."""
    h = hashlib.blake2b(f"{seed}:{step}:{what}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


#: per_step batches have a multiple of N * K / ROW_STEPS rows: at most this many train-step
#: compiles a run, each trained on at most 1 / ROW_STEPS of padding rows beyond its turns
ROW_STEPS = 8
#: ... in steps of at least this many rows: a small batch compiles once
MIN_ROW_STEP = 64


def refuse_stale(records: list[dict], version: int, max_lag: int) -> tuple[list[dict], int]:
    """Drops every group that holds a turn sampled by a policy older than ``version - max_lag``
    (a turn's ``policy_version`` is that of all its tokens). Whole groups go, so group baselines
    are never computed from a partial group. Returns ``(kept, refused trajectory count)``."""
    oldest_ok = version - max_lag
    stale_groups = {r["group"] for r in records
                    if any(int(t.get("policy_version", version)) < oldest_ok for t in r["turns"])}
    kept = [r for r in records if r["group"] not in stale_groups]
    return kept, len(records) - len(kept)


def staleness_metrics(records: list[dict], version: int) -> dict:
    """How old the rollouts a step trains on are: per turn, lag = ``version`` - the policy
    version that sampled it. ``async/lag_mean``, ``async/lag_max``, ``async/lag_<n>`` (the share
    of turns with lag n, for every n present) and ``async/mixed_version_frac`` (trajectories
    whose turns come from more than one version: partial rollouts that continued across a
    weight sync)."""
    lags = [version - int(t.get("policy_version", version)) for r in records for t in r["turns"]]
    if not lags:
        return {}
    out = {"async/lag_mean": sum(lags) / len(lags), "async/lag_max": float(max(lags))}
    for n in sorted(set(lags)):
        out[f"async/lag_{n}"] = lags.count(n) / len(lags)
    mixed = sum(len({int(t.get("policy_version", version)) for t in r["turns"]}) > 1
                for r in records)
    out["async/mixed_version_frac"] = mixed / len(records)
    return out


@dataclasses.dataclass
class Summary:
    steps: int
    eval_before: float | None
    eval_after_sft: float | None
    eval_final: float | None
    wall_s: float
    checkpoint_dir: str
    metrics_dir: str
    plots: list


class Trainer:
    """Builds everything a run needs from a ``RunConfig`` and runs it (``run()``).

    The run lives in one directory (``config.run_paths``). Unless ``read_only`` (evaluation),
    the trainer first takes the directory's lock, before anything in it is opened, created or
    cleaned; then a fresh run refuses a directory that holds another run (unless
    ``overwrite``: its outputs are deleted) and writes its resolved config there, and a
    ``resume`` checks the config against the run's own (``config.config_changes``: only
    ``RESUMABLE_KEYS`` may differ; each change is printed). ``close()`` (``run()`` calls it)
    releases the lock and the sampler.
    """

    def __init__(self, cfg: config_lib.RunConfig, *, resume: bool = False, progress: bool = True,
                 stream=None, overwrite: bool = False, read_only: bool = False):
        run_checks.validate(cfg)
        config_lib.check_paths(cfg)
        self.cfg, self.resume = cfg, resume
        self.paths = config_lib.run_paths(cfg)
        envs.first_errors.reset()  # this run's environment errors only
        self.out = stream if stream is not None else sys.stderr
        self.progress = progress
        self.read_only = read_only
        self._lock = None
        self.sampler = None
        self.workers = None  # RolloutWorkers while an async run trains
        if not read_only:
            self._take_run_dir(overwrite)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _take_run_dir(self, overwrite: bool) -> None:
        """The lock, then the fresh-vs-resume decision about the run directory's contents."""
        err = None
        if multihost.is_main_process():
            try:
                self._lock = lock_run_dir(self.paths.root)
            except (RunLockedError, config_lib.ConfigError) as e:
                err = (type(e).__name__, str(e))
        err = multihost.agree(err)  # every process stops, not only process 0
        if err is not None:
            raise (RunLockedError if err[0] == "RunLockedError" else config_lib.ConfigError)(err[1])
        try:
            msg = multihost.agree(self._prepare_run_dir(overwrite)
                                  if multihost.is_main_process() else None)
        except BaseException:
            self.close()
            raise
        if msg is not None:
            self.close()
            raise config_lib.ConfigError(msg)

    def _prepare_run_dir(self, overwrite: bool) -> str | None:
        """Process 0, holding the lock: an error message, or None when the run may go on."""
        root, found = self.paths.root, existing_outputs(self.paths.root)
        if self.resume:
            if os.path.exists(self.paths.config):
                saved = run_checks.from_dict(config_lib.read_yaml(self.paths.config))
                allowed, refused = config_lib.config_changes(saved, self.cfg)
                if refused and never_trained(root):  # nothing trained yet: the new settings
                    for k, a, b in refused:
                        self._say(f"--resume: {k} {a!r} -> {b!r} (the run has no checkpoint "
                                  "yet, so it starts with the new value)")
                    allowed, refused = allowed, []
                    write_config(self.cfg, self.paths.config)
                if refused:
                    return ("--resume: the run in " + root + " was started with other settings; "
                            "resume with the same values, or start a new run (--set name=NEW). "
                            "Different: " + "; ".join(f"{k}: the run has {a!r}, now {b!r}"
                                                       for k, a, b in refused))
                for k, a, b in allowed:
                    self._say(f"--resume: {k} {a!r} -> {b!r}")
                if allowed:
                    write_config(self.cfg, self.paths.config)
            elif found:
                return (f"--resume: {root} holds {', '.join(found)} but no config.yaml; it was "
                        f"not written by this version's trainer")
            else:
                write_config(self.cfg, self.paths.config)
            return None
        if found and not overwrite and never_trained(root):
            import shutil
            for n in found:
                p = os.path.join(root, n)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            self._say(f"{root}: the run there stopped before its first checkpoint (it holds "
                      f"only {', '.join(found)}); starting it again with this config")
            found = []
        if found and not overwrite:
            return (f"{root} already holds a run ({', '.join(found)}); continue it with "
                    f"`jaxrl-agent train --resume {root}`, start another one with "
                    f"`--set name=NEW`, or replace it with --overwrite")
        if found:
            import shutil
            for n in found:
                p = os.path.join(root, n)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
            self._say(f"--overwrite: removed {', '.join(found)} of the earlier run in {root}")
        write_config(self.cfg, self.paths.config)
        return None

    def _say(self, text: str) -> None:
        if self.progress and multihost.is_main_process():
            print(text, file=self.out, flush=True)

    def _build(self) -> None:
        cfg = self.cfg
        t = cfg.trainer
        if t.async_rollouts and jax.process_count() > 1:
            raise config_lib.ConfigError(
                "trainer.async_rollouts runs on one process for now (multi-host rollouts "
                "gather every process's records in step; a worker thread cannot join that "
                "collective): set trainer.async_rollouts: false")
        self.mesh = self._make_mesh()
        if t.attention == "splash" and self.mesh.devices.flat[0].platform != "tpu":
            raise config_lib.ConfigError(
                f"trainer.attention: splash is a TPU kernel and this run's devices are "
                f"{self.mesh.devices.flat[0].platform}: set trainer.attention: blocked")
        self.data_shards = sharding.batch_shards(self.mesh)
        self.model, self.codec, self.model_from = build_model(cfg, t.seed)
        mc, tp = self.model.config, self.mesh.shape["tensor"]
        if mc.num_heads % tp or mc.num_kv_heads % tp:  # also HF models (validate can't see them)
            raise config_lib.ConfigError(
                f"mesh.tensor={tp} must divide the model's attention heads ({mc.num_heads}) and "
                f"key/value heads ({mc.num_kv_heads}), so no head is split across devices")
        try:
            self.env = envs.make_env(cfg.env.name, **cfg.env.kwargs)
        except (ValueError, ImportError) as e:
            raise config_lib.ConfigError(f"env: {e}") from None
        own = getattr(type(self.env), "teacher_context", None)
        if cfg.teacher.context and (own is None or own is envs.Env.teacher_context):
            raise config_lib.ConfigError(
                f"teacher.context: the environment {cfg.env.name!r} "
                f"({type(self.env).__name__}) gives no per-task teacher context "
                f"(Env.teacher_context); use teacher.system_prompt for a fixed text")
        r = cfg.rollout
        if r.branch_turns and r.branch_factor > 1 and not callable(getattr(self.env, "fork",
                                                                           None)):
            raise config_lib.ConfigError(
                f"rollout.branch_turns needs an env that can fork mid-episode (Env.fork); "
                f"{type(self.env).__name__} has no fork()")
        bos = getattr(self.codec, "bos_token_id", None)
        self.rollout_cfg = r.collect_config(
            prompt_prefix=(bos,) if (r.bos and bos is not None) else ())
        self.eval_cfg = dataclasses.replace(self.rollout_cfg, group_size=1,
                                            temperature=t.eval_temperature, branch_turns=(),
                                            branch_factor=1)
        self.eval_tasks = self.env.sample_tasks(step_seed(t.seed, -1, "eval"), t.eval_tasks,
                                                "test")
        self.eval_distinct = max(len({task.id for task in self.eval_tasks}), 1)
        self._n_train = r.tasks_per_step * r.group_size * r.branch_factor ** len(r.branch_turns)
        self.optimizer = run_optimizer(cfg)
        self.lr_at = run_lr_schedule(cfg)
        self.pipeline = config_lib.pipeline(cfg)
        self.step_cfg = step_config(cfg, self.data_shards, self.pipeline)
        self.signal_stages = config_lib.signal_stages(cfg)
        self.teacher_model = load_teacher(cfg, self.model, self.codec)
        self.rules = {**sharding.DEFAULT_RULES, **cfg.mesh.rules}
        self.state_shardings = sharding.train_state_shardings(
            jax.eval_shape(self._init_state), self.optimizer, self.mesh, self.rules,
            trainable=trainable_of(self.model))
        # the old state is donated: the step writes the new one into its buffers (one copy of
        # parameters and optimizer state alive, not two)
        self.train_step = make_train_step(self.model, self.optimizer, self.step_cfg, donate=True,
                                          mesh=self.mesh, state_shardings=self.state_shardings,
                                          rules=self.rules, teacher_model=self.teacher_model)
        self.task_index: dict = {}
        self.checkpointer = Checkpointer(self.paths.checkpoints, every=cfg.checkpoint.every,
                                         keep=max(cfg.checkpoint.keep, 1),
                                         read_only=self.read_only)
        # Last: a vLLM sampler holds an engine (memory, maybe a GPU share) until close().
        self.sampler = build_sampler(cfg, self.model, batch_buckets=sampler_batch_buckets(
            cfg, jax.process_count()))
        self.call_size = self._size_sampler_calls()

    def close(self) -> None:
        """Releases the sampler's engine (vLLM) and the run directory's lock; ``run()`` calls
        it when it ends."""
        if self.sampler is not None and hasattr(self.sampler, "close"):
            self.sampler.close()
        if getattr(self, "checkpointer", None) is not None:
            self.checkpointer.close()
        if self._lock is not None:
            self._lock.close()  # releases the lock
            self._lock = None

    # ------------------------------------------------------------------ setup helpers

    def _size_sampler_calls(self) -> call_size.CallSize | None:
        """``sampler.call_rows``: N fixes the JAX sampler's rows per call; 0 sizes them to fit
        its device's memory beside the train state (``train.call_size``; None where the
        device reports no limit, CPU, or for vLLM, which sizes its own)."""
        s = self.cfg.sampler
        if not isinstance(self.sampler, JaxSampler):
            return None
        if s.call_rows:
            self.sampler.limit_call_rows(s.call_rows)
            return None
        device = min(jax.tree.leaves(self.sampler.state)[0].sharding.device_set,
                     key=lambda d: d.id)
        limit = call_size.device_memory_limit(device)
        if limit is None:
            return None
        state = sharding.local_bytes(jax.eval_shape(self._init_state), self.state_shardings)
        return call_size.size_sampler_calls(self.sampler, self.cfg, limit=limit, state=state,
                                            num_hosts=jax.process_count())

    def _make_mesh(self):
        try:
            return sharding.make_mesh(self.cfg.mesh)
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None

    def _print(self, text: str):
        if self.progress and multihost.is_main_process():
            if getattr(self, "logger", None) is not None:
                self.logger.event(text)
            else:
                print(text, file=self.out, flush=True)

    def _state_args(self) -> dict:
        """What the train state holds beside the policy: the frozen start copy (the KL term's
        reference, or the ``base`` teacher), an EMA teacher."""
        teacher = self.step_cfg.teacher if self.step_cfg.needs_teacher else "none"
        return dict(with_reference=(self.cfg.loss.kl_coef > 0 or teacher == "base"
                                    or self.step_cfg.needs_reference
                                    or self.step_cfg.policy_drift),
                    ema_teacher=teacher == "ema")

    def _teacher_params(self):
        """A checkpoint teacher's parameters (``()`` for any other teacher)."""
        if self.teacher_model is None:
            return ()
        return nnx.state(self.teacher_model, nnx.Param)

    def _init_state(self) -> TrainState:
        est_state = self.pipeline.init(self.cfg.trainer.task_capacity)
        return init_state(self.model, self.optimizer, seed=self.cfg.trainer.seed,
                          est_state=est_state, teacher_params=self._teacher_params(),
                          **self._state_args())

    def _fresh_state(self) -> TrainState:
        """A new train state laid out by the partition rules: the parameters are placed shard
        by shard, and the optimizer state (and KL reference) are created already sharded."""
        params = multihost.global_tree(jax.device_get(nnx.state(self.model, nnx.Param)),
                                       self.state_shardings.params)
        est_state = self.pipeline.init(self.cfg.trainer.task_capacity)
        init = functools.partial(init_state_from_params, optimizer=self.optimizer,
                                 seed=self.cfg.trainer.seed,
                                 trainable=trainable_of(self.model), **self._state_args())
        return jax.jit(init, out_shardings=self.state_shardings)(
            params, est_state=multihost.global_tree(jax.device_get(est_state),
                                                    sharding.replicated(self.mesh)),
            teacher_params=self._placed_teacher())

    def _placed_teacher(self):
        """A checkpoint teacher's parameters laid out by the partition rules (``()`` for any
        other teacher)."""
        if self.teacher_model is None:
            return ()
        return multihost.global_tree(jax.device_get(self._teacher_params()),
                                     self.state_shardings.teacher_params)

    def _restore_target(self):
        """Shapes, dtypes and shardings of the checkpointed train state (nothing allocated):
        orbax reads each process's slices straight into this layout (``_saved``'s view)."""
        return self._saved(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(self._init_state), self.state_shardings))

    def _saved(self, state):
        """What a checkpoint holds of ``state``: all of it, or with LoRA its trained
        parameters only (adapters, value head) beside the optimizer state; the frozen base is
        the run's model source (``_with_frozen``). A checkpoint teacher is never saved (it is
        read from its folder again)."""
        if self.teacher_model is not None:
            state = state.replace(teacher_params=())
        if not self.model.config.lora_rank:
            return state
        return state.replace(params=split_trainable(state.params, trainable_of(self.model))[0])

    def _with_frozen(self, state):
        """A restored ``_saved`` state made whole: the frozen base of a LoRA run from the
        weights it trained on (``<run.dir>/lora_base`` when a warm-up trained the base, else
        the run's model source), laid out like the train state."""
        if not self.model.config.lora_rank:
            return state
        filt = trainable_of(self.model)
        model = self.model
        folder = os.path.join(self.paths.root, LORA_BASE)
        if os.path.exists(os.path.join(folder, "config.json")):
            from jaxrl_agent.models.hf import load_hf
            model, _ = load_hf(folder, dtype=self.cfg.model.dtype, **lora_fields(self.cfg))
        frozen = split_trainable(jax.device_get(nnx.state(model, nnx.Param)), filt)[1]
        placed = multihost.global_tree(frozen, split_trainable(self.state_shardings.params,
                                                               filt)[1])
        return state.replace(params=nnx.merge_state(state.params, placed))

    def _shard_batch(self, batch):
        return multihost.global_tree(batch, sharding.batch_sharding(self.mesh))

    def prompt_summary(self) -> str:
        """How the policy's prompts are written: the checkpoint's chat template, or raw text
        (and then whether the checkpoint has a template the run leaves unused)."""
        if self.cfg.rollout.chat:
            return "prompts: the checkpoint's chat template (rollout.chat: true)"
        unused = ("; the checkpoint has a chat template, unused (rollout.chat: true uses it; "
                  "a task with a system message is refused without it)"
                  if getattr(self.codec, "chat_template", None) else "")
        return f"prompts: raw text, no chat template (rollout.chat: false){unused}"

    def layout_summary(self) -> str:
        """One line on the mesh, how much of the train state each device holds, and the paths
        the train step takes (layer scan + remat policy, chunked log-probs, attention)."""
        m = self.mesh.shape
        state = jax.eval_shape(self._init_state)
        total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
        local = sharding.local_bytes(state.params, self.state_shardings.params)
        return (f"mesh data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']} on "
                f"{self.mesh.size} x {jax.devices()[0].platform} ({jax.process_count()} "
                f"process{'es' if jax.process_count() > 1 else ''}); parameters "
                f"{local / 2**20:.1f} of {total / 2**20:.1f} MiB per device; "
                f"{lora_summary(self.model.config, state.params, self.sampler)}"
                f"{step_paths(self.step_cfg)}")

    # ------------------------------------------------------------------ rollouts & eval

    def _collect(self, tasks, cfg: RolloutConfig, seed: int):
        """Rollouts of ``tasks``: each process runs its share with its own sampler; every
        process gets all records (process order) and the merged statistics."""
        if jax.process_count() == 1:
            return collect_groups(self.env, tasks, self.sampler, self.codec, cfg, seed=seed)
        p = jax.process_index()
        mine = multihost.process_share(list(tasks))
        try:
            local = (collect_groups(self.env, mine, self.sampler, self.codec, cfg,
                                    seed=seed + 1_000_003 * p) if mine else ([], None))
        except Exception as e:  # tell the others, or they wait in the all-gather forever
            local = f"{type(e).__name__}: {e}"
        parts = multihost.allgather_objects(local)
        failed = [(i, x) for i, x in enumerate(parts) if isinstance(x, str)]
        if failed:
            raise RuntimeError("rollout collection failed on process(es) "
                               + "; ".join(f"{i}: {msg}" for i, msg in failed))
        records = [r for recs, _ in parts for r in recs]
        return records, _merge_stats([st for _, st in parts if st is not None])

    def evaluate(self, step: int) -> dict:
        """One rollout per held-out task at ``trainer.eval_temperature``: ``{"eval/success",
        "eval/success_se" (binomial standard error), "eval/reward", ...}``."""
        _, stats = self._collect(self.eval_tasks, self.eval_cfg,
                                 step_seed(self.cfg.trainer.seed, step, "eval"))
        self._watch_eval_errors(step, stats)
        n = max(stats["trajectories"], 1)
        # episodes of one task are not independent draws of the task population: the error
        # counts distinct tasks
        return {"eval/success": stats["success_rate"],
                "eval/success_se": success_se(stats["success_rate"], min(n, self.eval_distinct)),
                "eval/distinct_tasks": self.eval_distinct,
                "eval/reward": stats["mean_reward"],
                "eval/turns": stats["turns"] / n,
                "eval/invalid": stats["invalid_actions"] / n,
                "eval/env_errors": stats["env_errors"]}

    def _with_se(self, success: float) -> str:
        return (f"{success:.2f} +- {success_se(success, self.eval_distinct):.2f} (standard "
                f"error, {self._eval_count_words()})")

    def _eval_count_words(self) -> str:
        """What an evaluation averages over: ``n tasks``, or ``d distinct held-out tasks, n
        episodes`` when the held-out set has fewer tasks than ``trainer.eval_tasks``."""
        n, d = self.cfg.trainer.eval_tasks, self.eval_distinct
        return f"{d} distinct held-out tasks, {n} episodes" if d < n else f"{n} tasks"

    def split_summary(self) -> str | None:
        """How the env's tasks fall into the splits, and what evaluation draws (for envs with a
        fixed task list, e.g. a task file); None for generated tasks."""
        tasks = getattr(self.env, "tasks", None)
        if not isinstance(tasks, list) or not tasks:
            return None
        n_train = sum(t.split == "train" for t in tasks)
        n_test = len(tasks) - n_train
        line = (f"tasks: {n_train} train, {n_test} held-out (\"split\" fields, or a hash of "
                f"the id for tasks without one: docs/envs.md)")
        if n_test and n_test < self.cfg.trainer.eval_tasks:
            line += (f"; evaluation draws trainer.eval_tasks={self.cfg.trainer.eval_tasks} "
                     f"episodes from the {n_test} held-out tasks: each about "
                     f"{self.cfg.trainer.eval_tasks / n_test:.0f} times, and its standard "
                     f"error counts {n_test} tasks")
        return line

    def _sync(self, state: TrainState):
        params = state.params
        if jax.process_count() > 1:  # whole arrays on every host (local copy when replicated)
            params = multihost.host_gather(params)
        elif isinstance(self.sampler, JaxSampler):
            pass  # sync_weights moves each array from the train layout to the sampler's own
        elif not all(x.is_fully_replicated for x in jax.tree.leaves(params)):
            params = jax.device_put(params, sharding.replicated(self.mesh))  # on-device gather
        self.sampler.sync_weights(params, int(state.step))

    # ------------------------------------------------------------------ warm-up

    def _warmup(self):
        t = self.cfg.trainer
        if t.warmup_sft_steps <= 0:
            return
        demo_tasks = self.env.sample_tasks(step_seed(t.seed, -2, "sft"), t.sft_tasks, "train")
        try:
            records = sft_lib.demonstration_records(
                self.env, demo_tasks, self.codec, self.rollout_cfg, noise=t.sft_noise,
                seed=step_seed(t.seed, -4, "sft-noise"))
        except ValueError as e:
            raise config_lib.ConfigError(f"trainer.sft_noise: {e}") from None
        who = (f"a noisy solver (random action with probability {t.sft_noise:g})"
               if t.sft_noise else "solver demonstrations")
        self._print(f"supervised warm-up: {t.warmup_sft_steps} steps on {who} "
                    f"({len(demo_tasks)} episodes, {sum(len(r['turns']) for r in records)} turns)")
        t0 = time.time()

        def on_step(i, loss):
            if i == 1 or i % max(1, t.warmup_sft_steps // 5) == 0 or i == t.warmup_sft_steps:
                self._print(f"  warm-up step {i}/{t.warmup_sft_steps}: nll {loss:.3f} "
                            f"({time.time() - t0:.0f}s)")

        losses = sft_lib.run_sft(self.model, records, steps=t.warmup_sft_steps,
                                 batch_size=t.sft_batch_size, lr=t.sft_lr, layout=t.layout,
                                 seed=step_seed(t.seed, -3, "sft"), on_step=on_step)
        if self.cfg.checkpoint.export_warmup and multihost.is_main_process():
            self._export(self.paths.warmup_model)
            self._print(f"  warmed-up model saved to {self.paths.warmup_model} (HF format)")
        if self.model.config.lora_rank and multihost.is_main_process():
            # the base the adapters are trained on (checkpoints hold the adapters only)
            from jaxrl_agent.models.hf import save_hf
            save_hf(self.model, None, os.path.join(self.paths.root, LORA_BASE))
        # every process trained its own copy: take process 0's, so replicas can never disagree
        nnx.update(self.model, multihost.broadcast_from_main(
            jax.device_get(nnx.state(self.model, nnx.Param))))
        return losses

    # ------------------------------------------------------------------ the loop

    def _meta(self, step: int, extra: dict) -> dict:
        return {"step": step, "config": config_lib.to_dict(self.cfg),
                "task_index": self.task_index, **extra}

    def _pack(self, records):
        """One plan per batch: the packer's, with the sizes fixed in the per_step layout so a
        run compiles the step a few times at most: K = rollout.max_turns, rows of 16-token
        multiples, trajectories bucketed to 8 (more when whole groups fill one shard beyond
        it), and the row count rounded up to a multiple of N * K / ``ROW_STEPS`` (the rows the
        turns taken need, not one per possible turn: a run whose episodes end early trains
        on fewer padded rows)."""
        t = self.cfg.trainer
        recs = parse_records(attach_env_inputs(records, self.step_cfg.reads))
        plan = plan_packing(recs, t.layout, self.step_cfg.blocks)
        if t.layout == "per_step":
            shards = plan.num_shards
            # whole groups per shard: with fewer groups than shards some blocks stay empty
            n_traj = shards * max(math.ceil(bucket(len(recs), 8) / shards),
                                  plan.need["num_traj"] // shards)
            k = self.cfg.rollout.max_turns
            rows = round_up_to_step(plan.need["num_rows"], n_traj * k, ROW_STEPS, shards,
                                    min_step=MIN_ROW_STEP)
            plan = plan.padded(num_traj=n_traj, num_turns=k, num_rows=rows,
                               row_len=16 * math.ceil(plan.need["row_len"] / 16))
        batch, where = pack(recs, plan, task_index=self.task_index)
        if self.step_cfg.teacher_view and self.step_cfg.needs_teacher:
            batch = self._with_teacher_view(batch, records, plan)
        if len(self.task_index) > t.task_capacity and self.pipeline.stateful:
            raise RuntimeError(f"more than trainer.task_capacity={t.task_capacity} distinct "
                               f"tasks seen; raise it for {self.cfg.estimator.name!r}")
        return batch, np.asarray(where.traj)

    def _with_teacher_view(self, batch, records, plan):
        """``batch`` with the teacher's own rows (``train.step.TEACHER_VIEW``): the records with
        the teacher-only context in their prompts (``teacher.teacher_records``), packed into
        the same rows (``plan`` with longer rows)."""
        t = self.cfg.trainer
        try:
            view = teacher_records(records, self.cfg, self.codec.encode,
                                   self.rollout_cfg.prompt_prefix, t.layout)
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None
        recs = parse_records(view)
        need = plan_packing(recs, t.layout, self.step_cfg.blocks).need["row_len"]
        row_len = 16 * math.ceil(max(need, plan.sizes["row_len"]) / 16)
        tb, _ = pack(recs, plan.padded(row_len=row_len), task_index=dict(self.task_index))
        return batch.replace(extras={**batch.extras, "teacher_tokens": tb.tokens,
                                     "teacher_action_mask": tb.action_mask})

    def run(self) -> Summary:
        try:
            return self._run()
        finally:
            self.close()

    def _run(self) -> Summary:
        cfg, t = self.cfg, self.cfg.trainer
        wall0 = time.time()
        self._print(config_lib.describe(cfg))
        self._print(f"model: {self.model_from}; {self.layout_summary()}")
        self._print(self.prompt_summary())
        if self.call_size is not None:
            self._print(self.call_size.summary())
        for line in (teacher_summary(cfg, self.step_cfg.reads), self._signals_summary()):
            if line:
                self._print(line)
        split = self.split_summary()
        if split is not None:
            self._print(split)
        start, eval_before, eval_after_sft = 0, None, None
        restored = self._restore_newest_readable() if self.resume else None
        latest = None
        if self.resume and restored is None:
            self._print(f"--resume: no checkpoint in {self.paths.checkpoints}; starting fresh")
        if restored is not None:
            latest, state, meta = restored
            self.task_index = {k: int(v) for k, v in meta.get("task_index", {}).items()}
            start = int(meta["step"])
            eval_before, eval_after_sft = meta.get("eval_before"), meta.get("eval_after_sft")
            self._print(f"resumed from {self.paths.checkpoints} at step {start}")
        elif multihost.agree(self.checkpointer.all_steps()):  # never overwrite another run's
            raise config_lib.ConfigError(
                f"{self.paths.checkpoints} already holds checkpoints "
                f"{self.checkpointer.all_steps()}: pass --resume to continue that run")
        self.logger = None
        done, extra = None, {}
        try:
            if latest is None:
                self._sync_model_to_sampler(version=0)
                if t.warmup_sft_steps:  # one evaluation per state of the weights
                    eval_before = self.evaluate(-1)["eval/success"] if t.eval_every else None
                    if eval_before is not None:
                        self._print(f"held-out success before warm-up: "
                                    f"{self._with_se(eval_before)}")
                    self._warmup()
                state = self._fresh_state()
                self._sync(state)
                self._open_logger(None)
                if t.eval_every:
                    ev = self.evaluate(0)
                    eval_after_sft = ev["eval/success"]
                    if not t.warmup_sft_steps:  # the start is step 0's weights
                        eval_before = eval_after_sft
                    self.logger.log(0, ev)
                    self._print(f"held-out success at step 0"
                                f"{' (after warm-up)' if t.warmup_sft_steps else ''}: "
                                f"{self._with_se(eval_after_sft)}")
            else:
                self._sync(state)
                self._open_logger(start)
            extra = {"eval_before": eval_before, "eval_after_sft": eval_after_sft}
            last_eval = None
            done = None  # (step, state) of the newest step whose metrics are written
            if t.async_rollouts:
                self.workers = RolloutWorkers(self._collect_step, workers=t.rollout_workers,
                                              max_lag=t.max_policy_lag, first_step=start,
                                              last_step=t.steps, version=int(state.step))
            for s in range(start, t.steps):
                state, metrics, out = self._one_step(state, s)
                step = s + 1
                if t.eval_every and (step % t.eval_every == 0 or step == t.steps):
                    ev = self.evaluate(step)
                    metrics.update(ev)
                    last_eval = ev["eval/success"]
                self.logger.log(step, metrics)
                if out is not None:  # None: a signal plug-in failed, nothing was trained
                    self._write_samples(step, out)
                    self._last_out = out
                done = (step, state)
                self.checkpointer.save(step, self._saved(state), self._meta(step, extra),
                                       force=step == t.steps)
            return self._finish(state, wall0, eval_before, eval_after_sft, last_eval)
        except BaseException as e:
            # "at exit": keep the newest finished step (its metrics are written, so a resume
            # continues exactly after it).
            # (single process only: orbax saves are collective, and the other processes of a
            # multi-host job are not here; they keep the periodic checkpoints)
            if (done is not None and jax.process_count() == 1
                    and done[0] not in self.checkpointer.all_steps()):
                if _donated(done[1]):  # handed to the train step that was interrupted
                    self._print(f"the state of step {done[0]} went into the interrupted train "
                                "step (its buffers are reused), so it is not saved again")
                else:
                    self.checkpointer.save(done[0], self._saved(done[1]),
                                           self._meta(done[0], extra), force=True)
            if isinstance(e, KeyboardInterrupt):
                newest = self.checkpointer.latest_step()
                self._print(f"interrupted; newest checkpoint: step {newest} in "
                            f"{self.paths.checkpoints}; continue with `jaxrl-agent train "
                            f"--resume {self.paths.root}`"
                            if newest is not None else "interrupted before the first step")
            raise
        finally:
            if self.workers is not None:
                self.workers.close()
                self.workers = None
            if self.logger is not None:
                self.logger.close()
            self.checkpointer.close()

    def _restore_newest_readable(self):
        """``(step, state, meta)`` of the newest checkpoint that reads back, or None when there
        is none. Newer ones that fail to read (a truncated file, deleted metadata) are said,
        set aside as ``<step>.unreadable`` (never deleted) and skipped; none readable is an
        error naming every step and why."""
        steps = multihost.agree(self.checkpointer.all_steps())
        failures = []
        for step in reversed(steps):
            try:
                state, meta = self.checkpointer.restore(self._restore_target(), step)
                self._check_resume_config(meta)
                err = None
            except config_lib.ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - any unreadable file: try the previous step
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            errs = [x for x in multihost.allgather_objects(err)] if jax.process_count() > 1 \
                else [err]
            err = next((x for x in errs if x is not None), None)
            if err is None:
                if failures and not self.read_only:
                    self._set_aside([f for f, _ in failures])
                state = self._with_frozen(state)
                if self.teacher_model is not None:
                    state = state.replace(teacher_params=self._placed_teacher())
                return step, state, meta
            failures.append((step, err))
            self._print(f"--resume: checkpoint step {step} cannot be read ({err}); trying the "
                        f"previous one")
        if failures:
            raise config_lib.ConfigError(
                f"--resume: no checkpoint in {self.paths.checkpoints} can be read: "
                + "; ".join(f"step {st}: {e}" for st, e in failures))
        return None

    def _set_aside(self, steps) -> None:
        """Renames unreadable step directories to ``<step>.unreadable[.n]`` (process 0), so the
        resumed run can save those steps again and nothing is deleted."""
        if multihost.is_main_process():
            for step in steps:
                src = os.path.join(self.paths.checkpoints, str(step))
                dst, n = f"{src}.unreadable", 1
                while os.path.exists(dst):
                    dst, n = f"{src}.unreadable.{n}", n + 1
                os.rename(src, dst)
                self._print(f"--resume: set aside the unreadable step {step} as {dst}")
        multihost.sync_hosts("set-aside")
        self.checkpointer.reload()

    def _export(self, folder: str) -> None:
        """The current model as an HF folder, with its tokenizer: the byte codec's own files,
        or the files of the HF folder it was loaded from, so ``jaxrl-agent sample FOLDER``
        works on every model the trainer writes."""
        from jaxrl_agent.models.hf import save_hf, save_peft_adapter
        save_hf(self.model, None, folder)  # LoRA: the adapters merged into the base
        mc = self.model.config
        if mc.lora_rank and mc.lora_train_norms:
            self._print(f"{folder}: no adapter/ folder: model.lora.train_norms trained the "
                        f"norms too, which a LoRA adapter does not hold; {folder} (merged) is "
                        f"the trained policy")
        elif mc.lora_rank:  # ... and alone, as a PEFT folder on the base it was trained on:
            # the warm-up's (it trains the base in place) or the start's
            base = os.path.join(self.paths.root, LORA_BASE)
            if not os.path.isfile(os.path.join(base, "config.json")):
                base = self.cfg.model.hf_path or self.paths.base_model
            save_peft_adapter(self.model, os.path.join(folder, "adapter"),
                              base_model_name_or_path=os.path.abspath(base))
        if hasattr(self.codec, "save_pretrained"):
            self.codec.save_pretrained(folder)
        elif self.cfg.model.hf_path is not None:
            import shutil

            from jaxrl_agent.models.tokenizer import TOKENIZER_FILES
            for name in TOKENIZER_FILES:
                src = os.path.join(self.cfg.model.hf_path, name)
                if os.path.exists(src):
                    shutil.copy2(src, os.path.join(folder, name))

    def _open_logger(self, resume_from_step):
        if not multihost.is_main_process():
            self.logger = _NullLogger()
            return
        m = self.cfg.metrics
        wandb = (dict(project=m.wandb_project, name=self.cfg.name,
                      config=config_lib.to_dict(self.cfg)) if m.wandb else None)
        self.logger = MetricsLogger(self.paths.metrics, total_steps=self.cfg.trainer.steps,
                                    tensorboard=self.cfg.metrics.tensorboard, wandb=wandb,
                                    progress=self.progress, stream=self.out,
                                    resume_from_step=resume_from_step)

    def _sync_model_to_sampler(self, version: int):
        self.sampler.sync_weights(self.model, version)

    def _check_resume_config(self, meta: dict):
        """The checkpoint's own copy of the config agrees with this one on every key that
        changes what is learned (``config.config_changes``)."""
        try:
            saved = run_checks.from_dict(meta.get("config", {}))
        except config_lib.ConfigError as e:
            raise config_lib.ConfigError(f"--resume: the checkpoint's config cannot be read "
                                         f"({e})") from None
        _, refused = config_lib.config_changes(saved, self.cfg)
        if refused:
            raise config_lib.ConfigError(
                "--resume: the checkpoint was written with other settings: "
                + "; ".join(f"{k}: the checkpoint has {a!r}, now {b!r}" for k, a, b in refused))

    def _collect_step(self, s: int):
        """Step ``s``'s rollouts: its tasks (a stream fixed by the seed and the step) collected
        with the sampler's current weights. Called by the trainer, or by a rollout worker
        thread with ``trainer.async_rollouts``."""
        t, r = self.cfg.trainer, self.cfg.rollout
        tasks = self.env.sample_tasks(step_seed(t.seed, s, "tasks"), r.tasks_per_step, "train")
        records, stats = self._collect(tasks, self.rollout_cfg, step_seed(t.seed, s, "rollout"))
        return self._with_signals(records, stats)

    def _with_signals(self, records, stats):
        """The records with the signal plug-ins' fields (``train.signals``); a plug-in that
        raised leaves the step without records (``stats["signal_error"]``: head, traceback),
        which the trainer counts and skips."""
        stats = dict(stats, signal_errors=0)
        if not self.signal_stages or not records:
            return records, stats
        try:
            return run_signals(records, self.signal_stages), stats
        except SignalError as e:
            return [], dict(stats, signal_errors=1, signal_error=(e.head, e.tb))

    def _signals_summary(self) -> str:
        if not self.signal_stages:
            return ""
        fields = run_checks.signal_fields(self.cfg)
        return (f"signals: {', '.join(n for n, _ in self.signal_stages)} on the host after "
                f"each collection{' (in the rollout workers)' if self.cfg.trainer.async_rollouts else ''}"
                f", providing {', '.join(f'{k} ({v})' for k, v in sorted(fields.items()))}")

    def _one_step(self, state: TrainState, s: int):
        t = self.cfg.trainer
        t0 = time.perf_counter()
        if self.workers is not None:  # collected ahead by a worker thread (waits if not yet)
            records, stats = self.workers.get(s)
        else:
            records, stats = self._collect_step(s)
        self._watch_env_errors(s + 1, stats)
        if self._watch_signal_errors(s + 1, stats):  # a judge failed: nothing to train on
            return state, {"train/signal_errors": 1.0, "train/env_errors": stats["env_errors"],
                           "time/rollout_s": time.perf_counter() - t0}, None
        self._save_records(s + 1, records)
        version = int(state.step)
        lags = staleness_metrics(records, version) if t.max_policy_lag else {}
        records, refused = refuse_stale(records, version, t.max_policy_lag)
        if not records:
            raise StaleBatchError(f"step {s}: all {refused} trajectories were sampled by "
                                  f"policies older than version {version} - "
                                  f"trainer.max_policy_lag ({t.max_policy_lag})")
        t1 = time.perf_counter()
        if t.shuffle_outcomes:  # the null control: the credit loses its relation to the episodes
            records = shuffled_outcomes(records, seed=t.seed * 1_000_003 + s)
        batch, traj = self._pack(records)
        shared = {}
        if t.prefix_sharing:  # one forward/backward per prefix tree, the same loss and gradient
            batch, tree = attach_prefix_trees(batch, self.step_cfg.blocks,
                                              t.prefix_tree_len or None,
                                              attn_cost=attention_cost(self.model.config))
            shared = {"train/prefix_tokens_ratio": tree["total_tokens"] / max(
                tree["unique_tokens"], 1), "train/prefix_tree_slots": tree["rows"] * tree["row_len"]}
        batch = self._shard_batch(batch)
        if self.workers is None and isinstance(self.sampler, JaxSampler):
            # no rollout runs during the step: the sampler's copy of the weights is freed
            # until the sync after it (one copy of the weights beside the step, not two)
            self.sampler.release_weights()
        state, out = self.train_step(state, batch)
        m = jax.device_get(out["metrics"])
        t2 = time.perf_counter()
        self._sync(state)
        t3 = time.perf_counter()
        if self.workers is not None:
            self.workers.advance(int(state.step))
        if m["update_skipped"]:
            self._print(f"step {s + 1}: non-finite loss or gradient in {int(m['update_skipped'])} "
                        f"update(s), skipped ({int(state.skipped)} so far)")
        n = max(stats["trajectories"], 1)
        self._last_success = stats["success_rate"]
        metrics = {
            "train/reward": stats["mean_reward"], "train/success": stats["success_rate"],
            "train/turns": stats["turns"] / n, "train/invalid": stats["invalid_actions"] / n,
            "train/env_errors": stats["env_errors"], "train/stale_refused": refused,
            "train/signal_errors": float(stats.get("signal_errors", 0)),
            "train/tokens_per_s": stats["tokens_generated"] / max(
                stats["wall_time_s"] if self.workers is not None else t2 - t0, 1e-9),
            "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": t3 - t2,
            "train/lr": self.lr_at(version),
            **lags,
            **{f"train/{k}": float(v) for k, v in m.items()},
            "train/skipped_total": int(state.skipped), "train/idle_total": int(state.idle),
            **_length_stats(records), **shared,
        }
        probe = getattr(self.sampler, "last_sync", {}).get("probe_error")
        if probe is not None:
            metrics["sampler/probe_error"] = probe
        if "chat_rerender_differs" in stats:  # chat rollouts (docs/envs.md)
            metrics["train/chat_rerender_differs"] = stats["chat_rerender_differs"] / n
        # the per-turn credit of each record (a global computation, then its small [N, K]
        # gathered on every process; row i = records[i], whatever block the packer put it in)
        turn = np.asarray(jax.device_get(multihost.host_gather(
            turn_credit(batch, out["advantages"]))))[traj]
        metrics.update(episode_metrics(records))
        metrics.update(credit_metrics(records, turn))
        self._watch_signal(s + 1, m)
        self._watch_truncation(s + 1, metrics.get("train/response_truncated_frac", 0.0))
        return state, metrics, (records, turn)

    def _write_samples(self, step: int, out) -> None:
        """A few of the step's trajectories as text (``sample_conversations``) in
        ``<run.dir>/rollouts/step_<N>.jsonl`` (``metrics.rollout_samples`` of them; 0: none),
        read by ``jaxrl-agent show``."""
        n = self.cfg.metrics.rollout_samples
        if not n:
            return
        records, turn = out  # the file is process 0's
        if not multihost.is_main_process():
            return
        folder = os.path.join(self.paths.root, "rollouts")
        os.makedirs(folder, exist_ok=True)
        rows = sample_conversations(records, turn, self.codec, limit=n)
        if self.logger is not None:  # TensorBoard's Text tab: the same samples, readable
            self.logger.text(step, "rollouts", samples_markdown(rows))
        tmp = os.path.join(folder, f".step_{step}.jsonl.tmp")
        with open(tmp, "w") as f:
            for r in rows:
                f.write(json.dumps({"step": step, **r}) + "\n")
        os.replace(tmp, os.path.join(folder, f"step_{step}.jsonl"))

    def _watch_truncation(self, step: int, frac: float) -> None:
        """Says once when most replies of ``NO_SIGNAL_STEPS`` steps in a row were cut at
        ``rollout.max_new_tokens`` (a chat task under the grid world's 8 tokens, say)."""
        self._cut_steps = getattr(self, "_cut_steps", 0) + 1 if frac > 0.5 else 0
        if self._cut_steps == self.NO_SIGNAL_STEPS and not getattr(self, "_said_cut", False):
            self._said_cut = True
            self._print(f"steps {step - self.NO_SIGNAL_STEPS + 1}-{step}: {100 * frac:.0f}% of "
                        f"the replies were cut at rollout.max_new_tokens "
                        f"({self.cfg.rollout.max_new_tokens} tokens) before a stop token "
                        f"(train/response_truncated_frac): raise rollout.max_new_tokens if "
                        f"the task needs longer replies")

    #: consecutive steps without any learning signal before the run says so (once)
    NO_SIGNAL_STEPS = 3

    def _show_new_errors(self, when: str, counter: str) -> None:
        """The first traceback of every new kind of environment / reward exception, shown once
        (labelled ``when``) and appended to ``<run>/env_errors.log``; later ones of a kind are
        only counted (``counter``)."""
        new = envs.first_errors.take_new()
        if new and multihost.is_main_process():
            log = os.path.join(self.paths.root, "env_errors.log")
            if not self.read_only:
                with open(log, "a") as f:
                    for head, tb in new:
                        f.write(f"{when}: {head}\n{tb}\n")
            for head, tb in new:
                self._print(f"{when}: an environment raised {head}; the trajectory ended "
                            f"there with reward 0; later ones of this kind are only counted "
                            f"({counter})" + (
                                "" if not tb else "; traceback" + (
                                    "" if self.read_only else f" (also in {log})")
                                + f":\n{tb.rstrip()}"))
        if new:
            self._first_env_error = getattr(self, "_first_env_error", None) or new[0][0]

    def _watch_eval_errors(self, step: int, stats: dict) -> None:
        """Environment errors of an evaluation: shown as the evaluation's (not the next
        training step's), said when they count as failures in ``eval/success``, and, when
        every held-out episode failed so, the run stops (``trainer.max_failed_steps`` > 0):
        an evaluation of errors is no evaluation of the policy."""
        when = "evaluation before warm-up" if step < 0 else f"evaluation at step {step}"
        self._show_new_errors(when, "eval/env_errors")
        n, failed = stats["trajectories"], stats["env_errors"]
        if not failed:
            return
        self._eval_errors = getattr(self, "_eval_errors", 0) + failed
        if failed >= n and (self.cfg.trainer.max_failed_steps or not n):
            raise EnvFailureError(
                f"{when}: every held-out episode ended in an environment error (first: "
                f"{getattr(self, '_first_env_error', None) or 'see eval/env_errors'}); the "
                f"run stops here (trainer.max_failed_steps: {self.cfg.trainer.max_failed_steps};"
                f" 0 never stops)")
        self._print(f"{when}: {failed} of {n} held-out episodes ended in an environment error "
                    f"(eval/env_errors); eval/success counts them as failures")

    def _watch_env_errors(self, step: int, stats: dict) -> None:
        """Shows the first traceback of every new kind of environment / reward exception once
        (and appends it to ``<run>/env_errors.log``); stops the run with ``EnvFailureError``
        when every trajectory of ``trainer.max_failed_steps`` steps in a row failed."""
        self._show_new_errors(f"step {step}", "train/env_errors")
        n, failed = stats["trajectories"], stats["env_errors"]
        if failed and not n:  # every trajectory failed at its start: nothing was collected
            raise EnvFailureError(
                f"step {step}: every trajectory failed before its first turn: "
                f"{getattr(self, '_first_env_error', None) or 'see train/env_errors'}")
        self._failed_steps = getattr(self, "_failed_steps", 0) + 1 if n and failed >= n else 0
        limit = self.cfg.trainer.max_failed_steps
        if limit and self._failed_steps >= limit:
            raise EnvFailureError(
                f"steps {step - limit + 1}-{step}: every trajectory ended in an environment "
                f"error (first: {getattr(self, '_first_env_error', None) or 'see train/env_errors'})"
                f"; the run "
                f"stops here (trainer.max_failed_steps: {limit}; 0 never stops). Tracebacks: "
                f"{os.path.join(self.paths.root, 'env_errors.log')}")

    def _watch_signal_errors(self, step: int, stats: dict) -> bool:
        """Whether a signal plug-in failed on this step's records. The first failure of each
        kind is shown once with the plug-in's traceback (and appended to
        ``<run>/env_errors.log``); the run stops with ``EnvFailureError`` after
        ``trainer.max_failed_steps`` such steps in a row."""
        failed = stats.get("signal_error")
        self._signal_failed_steps = (getattr(self, "_signal_failed_steps", 0) + 1
                                     if failed else 0)
        if not failed:
            return False
        head, tb = failed
        seen = getattr(self, "_signal_heads", set())
        self._signal_heads = seen
        if head not in seen and multihost.is_main_process():
            seen.add(head)
            log = os.path.join(self.paths.root, "env_errors.log")
            with open(log, "a") as f:
                f.write(f"step {step}: {head}\n{tb}\n")
            self._print(f"step {step}: {head}; this step trains on nothing (counted in "
                        f"train/signal_errors; later ones of this kind are only counted); "
                        f"traceback (also in {log}):\n{tb.rstrip()}")
        limit = self.cfg.trainer.max_failed_steps
        if limit and self._signal_failed_steps >= limit:
            raise EnvFailureError(f"steps {step - limit + 1}-{step}: a signal plug-in failed "
                                  f"on every step ({head}); the run stops here "
                                  f"(trainer.max_failed_steps: {limit}; 0 never stops)")
        return True

    def _save_records(self, step: int, records) -> None:
        """The step's records as collected (with the signal plug-ins' fields) in
        ``<run.dir>/rollouts/records_<step>.jsonl`` when ``metrics.save_records`` is on: the
        form ``jaxrl-agent credit`` reads, so an offline analysis sees what the run trained
        on."""
        if not self.cfg.metrics.save_records or not multihost.is_main_process():
            return
        folder = os.path.join(self.paths.root, "rollouts")
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".records_{step}.jsonl.tmp")
        with open(tmp, "w") as f:
            for r in records:
                f.write(json.dumps(r, default=_json_default) + "\n")
        os.replace(tmp, os.path.join(folder, f"records_{step}.jsonl"))

    def _watch_signal(self, step: int, m: dict) -> None:
        """Says once when ``NO_SIGNAL_STEPS`` steps in a row had every advantage 0 (every
        update skipped as idle): the run is not learning, and the likely causes."""
        if m["adv_zero_frac"] < 1.0 or m["updates"] > 0:
            self._no_signal_since = None
            return
        since = getattr(self, "_no_signal_since", None) or step
        self._no_signal_since = since
        if step - since + 1 == self.NO_SIGNAL_STEPS and not getattr(self, "_said_no_signal",
                                                                     False):
            self._said_no_signal = True
            self._print(
                f"steps {since}-{step}: every advantage was 0, so nothing was learned (the "
                f"rollouts of every task scored alike: train/group_zero_frac "
                f"{m['group_zero_frac']:.2f}, train/success {self._last_success:.2f}). Likely "
                f"causes: the tasks are all too easy or too hard for the policy, "
                f"rollout.group_size is too small to see a difference, or the reward does not "
                f"vary (its scale, the env's reward); docs/training.md, 'Diagnostics'")

    # ------------------------------------------------------------------ the end

    def _finish(self, state, wall0, eval_before, eval_after_sft, last_eval) -> Summary:
        cfg = self.cfg
        plots = []
        # Collectives first, on every process; the files below belong to process 0.
        last_out = getattr(self, "_last_out", None)
        params = multihost.host_gather(state.params) if cfg.checkpoint.export else None
        main = multihost.is_main_process()
        if cfg.metrics.plots and main:
            from jaxrl_agent.train import plots as plots_lib
            rows = read_metrics(self.logger.path)
            d = pathlib.Path(self.paths.metrics)
            plots.append(plots_lib.learning_curve(rows, d / "learning_curve.png",
                                                  title=f"{cfg.name}: {cfg.estimator.name} on "
                                                        f"{cfg.env.name}"))
            if last_out is not None:
                plots.append(plots_lib.credit_picture(credit_trajectories(*last_out),
                                                      d / "credit.png",
                                                      title=f"per-turn credit "
                                                            f"({cfg.estimator.name})"))
        export = None
        if cfg.checkpoint.export and main:
            nnx.update(self.model, params)
            self._export(self.paths.final_model)
            export = self.paths.final_model
        wall = time.time() - wall0
        lines = [f"done: {int(state.step)} steps in {wall / 60:.1f} min"]
        if eval_before is not None:
            lines.append(f"  held-out success: {eval_before:.2f} at start"
                         + (f", {eval_after_sft:.2f} after warm-up"
                            if cfg.trainer.warmup_sft_steps and eval_after_sft is not None else "")
                         + (f", {last_eval:.2f} at the end" if last_eval is not None else "")
                         + f" (standard error <= {success_se(0.5, self.eval_distinct):.2f} "
                           f"each, {self._eval_count_words()})")
            if getattr(self, "_eval_errors", 0):
                lines.append(f"  (of which {self._eval_errors} held-out episodes ended in an "
                             f"environment error and count as failures: eval/env_errors)")
        lines.append(f"  run:         {os.path.abspath(self.paths.root)} (resume: "
                     f"jaxrl-agent train --resume {self.paths.root})")
        lines.append(f"  checkpoints: {os.path.abspath(self.paths.checkpoints)}")
        lines.append(f"  metrics:     {os.path.abspath(self.logger.path or self.paths.metrics)}"
                     + (" (+ TensorBoard: tb/)" if cfg.metrics.tensorboard else ""))
        for p in plots:
            lines.append(f"  plot:        {os.path.abspath(p)}")
        if export:
            lines.append(f"  final model: {os.path.abspath(export)} (HF format)")
        self._print("\n".join(lines))
        return Summary(int(state.step), eval_before, eval_after_sft, last_eval, wall,
                       self.paths.checkpoints, self.paths.metrics, [str(p) for p in plots])


class _NullLogger:
    """The metrics logger of processes other than 0 (which owns the files)."""

    path = None

    def log(self, step, metrics):
        pass

    def event(self, text):
        pass

    def close(self):
        pass


def _json_default(x):
    """numpy scalars and arrays in records, as JSON numbers and lists."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _donated(tree) -> bool:
    """Some array of ``tree`` was donated to a jitted call (its buffer is gone)."""
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(tree))


def _merge_stats(parts: list) -> dict:
    """Rollout statistics of several processes as if one collector had run them all."""
    out = {k: sum(p[k] for p in parts) for k in parts[0]
           if k not in ("success_rate", "mean_reward", "wall_time_s", "tokens_per_s",
                        "chat_template_prefix_stable")}
    if "chat_template_prefix_stable" in parts[0]:  # one template: stable on every process or none
        out["chat_template_prefix_stable"] = min(p["chat_template_prefix_stable"] for p in parts)
    n = out["trajectories"]
    out["success_rate"] = out["successes"] / n if n else 0.0
    out["mean_reward"] = sum(p["mean_reward"] * p["trajectories"] for p in parts) / n if n else 0.0
    out["wall_time_s"] = max(p["wall_time_s"] for p in parts)
    out["tokens_per_s"] = out["tokens_generated"] / max(out["wall_time_s"], 1e-9)
    return out


def _length_stats(records) -> dict:
    """Response lengths (sampled tokens) per turn and per trajectory of a step's records."""
    turns = [len(t["action"]) for r in records for t in r["turns"]]
    trajs = [sum(len(t["action"]) for t in r["turns"]) for r in records]
    if not turns:
        return {}
    cut = [t.get("finish_reason") == "length" for r in records for t in r["turns"]]
    return {"train/response_len_turn": float(np.mean(turns)),
            "train/response_truncated_frac": float(np.mean(cut)),
            "train/response_len_turn_max": int(max(turns)),
            "train/response_len_traj": float(np.mean(trajs)),
            "train/response_len_traj_max": int(max(trajs))}


def _restored(run, step: int | None, overrides=()):
    """``(trainer, state, meta)``: a run rebuilt read-only from its own config (``overrides``
    as in ``--set``) on this machine's devices (one process, data-parallel: the run may have
    used a bigger mesh or several hosts), with its checkpoint at ``step`` (default the newest
    readable one) restored and synced to its sampler. Nothing in the run is written or
    locked; the caller closes the trainer."""
    cfg = run_config(run, overrides)
    d = config_lib.to_dict(cfg)
    d["mesh"] = {"data": -1, "fsdp": 1, "tensor": 1, "rules": d["mesh"]["rules"]}
    d["distributed"] = {}
    cfg = run_checks.from_dict(config_lib.apply_overrides(d, overrides))
    trainer = Trainer(cfg, resume=True, progress=False, read_only=True)
    try:
        if step is None:
            found = trainer._restore_newest_readable()
            if found is None:
                raise config_lib.ConfigError(f"no complete checkpoint in "
                                             f"{trainer.paths.checkpoints}")
            _, state, meta = found
        else:
            if step not in trainer.checkpointer.all_steps():
                raise config_lib.ConfigError(
                    f"no complete checkpoint for step {step} in {trainer.paths.checkpoints} "
                    f"(steps: {trainer.checkpointer.all_steps() or 'none'})")
            state, meta = trainer.checkpointer.restore(trainer._restore_target(), step)
            state = trainer._with_frozen(state)
        trainer._sync(state)
    except BaseException:
        trainer.close()
        raise
    return trainer, state, meta


def evaluate_run(run, *, step: int | None = None, num_tasks: int | None = None,
                 split: str = "test", overrides=()) -> dict:
    """Held-out evaluation of a run's checkpoint (the newest readable one, or ``step``): the
    run is rebuilt from its own config (``overrides`` as in ``--set``), nothing in it is
    written or locked (a run that is still training can be evaluated), and ``num_tasks``
    tasks of ``split`` (default: the run's held-out eval set) are rolled out at the run's
    ``trainer.eval_temperature``."""
    trainer, state, meta = _restored(run, step, overrides)
    cfg = trainer.cfg
    try:
        if num_tasks is not None or split != "test":
            n = num_tasks if num_tasks is not None else cfg.trainer.eval_tasks
            trainer.eval_tasks = trainer.env.sample_tasks(
                step_seed(cfg.trainer.seed, -1, "eval" if split == "test" else "eval-train"),
                n, split)
        res = trainer.evaluate(int(meta["step"]))
    finally:
        trainer.close()
    return {"step": int(meta["step"]), "split": split, "tasks": len(trainer.eval_tasks),
            **{k.split("/", 1)[1]: float(v) for k, v in res.items()}}


@dataclasses.dataclass(frozen=True)
class RunPolicy:
    """A run's policy at one checkpoint, with what its rollouts used to prompt it: the
    ``model`` (a ``Transformer`` holding the checkpoint's weights), its ``codec``, the
    collector's ``rollout`` config (prompt prefix, observation template, history), the run's
    ``env``, its held-out ``eval_tasks``, the run's ``cfg`` and the checkpoint's ``step``."""

    model: Any
    codec: Any
    rollout: Any
    env: Any
    eval_tasks: list
    cfg: Any
    step: int


def load_run_policy(run, *, step: int | None = None, overrides=()) -> RunPolicy:
    """A run's policy at a checkpoint (the newest readable one, or ``step``) for analysis
    (``RunPolicy``; a LoRA run's model holds its frozen base too). Nothing in the run is
    written or locked."""
    trainer, state, meta = _restored(run, step, overrides)
    try:
        nnx.update(trainer.model, state.params)
        return RunPolicy(trainer.model, trainer.codec, trainer.rollout_cfg, trainer.env,
                         list(trainer.eval_tasks), trainer.cfg, int(meta["step"]))
    finally:
        trainer.close()
