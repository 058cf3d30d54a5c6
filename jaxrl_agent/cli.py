"""The ``jaxrl-agent`` command line.

  jaxrl-agent train [CONFIG.yaml] [--set section.key=value ...] [--resume [RUN]] [--overwrite]
  jaxrl-agent eval RUN [--step N] [--tasks N] [--split test|train]
  jaxrl-agent show RUN [--step N]              (sampled conversations of a step, as text)
  jaxrl-agent credit ROLLOUTS.jsonl --estimator NAME [--shaping NAME ...] [--then NAME ...]
                     [--set key=value | --set stage.key=value ...] [--layout ...] --out OUT
  jaxrl-agent estimators
  jaxrl-agent lab [--estimators a,b,...] [--task tree|gridworld|chain|distractor] [--seeds N]
                  [--task-set key=value ...] [--group-sizes G,...] [--num-groups B,...] [--out DIR]
  jaxrl-agent convert HF_DIR OUT_DIR [--dtype ...] [--max-shard-bytes N]
  jaxrl-agent sample HF_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] ...
  jaxrl-agent plan [CONFIG.yaml] --topology cpu:8|v5e:2x4|... [--hf-config NAME|PATH] [--set ...]
                   [--fit micro_batches]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import tempfile
import time

import numpy as np
import yaml

from jaxrl_agent.config import yaml_load


class CliError(Exception):
    """An error the user can fix; printed without a traceback, exit status 2."""


def _parse_sets(items):
    params = {}
    for item in items or []:
        if "=" not in item:
            raise CliError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        try:
            params[key.strip()] = yaml_load(raw)  # reads 1e-6 as a float (YAML 1.1 does not)
        except yaml.YAMLError as e:
            raise CliError(f"--set {item!r}: cannot parse the value ({e})") from None
    return params


def read_records(path: str):
    """Reads a JSONL file of rollout records; returns (records, line number of each record)."""
    from jaxrl_agent.config import ConfigError, read_text

    try:
        text = read_text(path, "rollout file")
    except ConfigError as e:
        raise CliError(str(e)) from None
    records, lines = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(rec, dict):
            raise CliError(f"{path}:{lineno}: a record must be a JSON object, got "
                           f"{type(rec).__name__}")
        records.append(rec)
        lines.append(lineno)
    if not records:
        raise CliError(f"{path}: no rollout records (the file is empty)")
    return records, lines


def check_output_path(out: str, inputs=()) -> None:
    """``CliError`` unless ``out`` can be written as a new or replaced file: not a directory,
    not one of ``inputs`` (the same file under any name), in a writable directory."""
    if os.path.isdir(out):
        raise CliError(f"--out {out}: is a directory; give a file name")
    for src in inputs:
        if os.path.exists(out) and os.path.exists(src) and os.path.samefile(out, src):
            raise CliError(f"--out {out} is the input {src}; it would be overwritten: write "
                           f"to another file")
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.exists(parent) and not os.access(parent, os.W_OK):
        raise CliError(f"--out {out}: the directory {parent} is not writable")


def _write_atomic(path: str, lines) -> None:
    """Writes all lines to a temporary file beside ``path``, then renames it into place; the
    file gets the permissions a newly created file would (0666 minus the umask)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _round(x) -> float:
    return float(np.round(float(x), 6))


def credit_rows(records, index, batch, adv):
    """Per-record output dicts: per-turn credit and per-token credit of each turn's actions."""
    outcome = np.asarray(batch.outcome)
    token = np.asarray(adv.token)
    turn = None if adv.turn is None else np.asarray(adv.turn)
    turn_ret = None if adv.turn_returns is None else np.asarray(adv.turn_returns)
    tok_ret = None if adv.token_returns is None else np.asarray(adv.token_returns)
    for i, rec in enumerate(records):
        n = index.traj[i]
        spans = index.spans[i]
        tok = [[_round(v) for v in token[r, a:b]] for r, a, b in spans]
        if turn is not None:
            per_turn = [_round(turn[n, k]) for k in range(len(spans))]
        else:
            per_turn = [_round(np.mean(t)) for t in tok]
        row = {"record": i, "group": rec["group"], "task": rec.get("task", rec["group"]),
               "outcome": _round(outcome[n]),
               "turn_credit": per_turn, "token_credit": tok}
        if turn_ret is not None:
            row["turn_returns"] = [_round(turn_ret[n, k]) for k in range(len(spans))]
        if tok_ret is not None:
            row["token_returns"] = [[_round(v) for v in tok_ret[r, a:b]] for r, a, b in spans]
        yield row


def summary_table(rows) -> str:
    """Mean per-turn credit by turn index and the fraction of positive credit."""
    by_turn: dict = {}
    for row in rows:
        for k, c in enumerate(row["turn_credit"]):
            by_turn.setdefault(k, []).append(c)
    lines = [f"{'turn':>4}  {'n':>6}  {'mean credit':>11}  {'min':>8}  {'max':>8}  {'positive':>8}"]
    for k in sorted(by_turn):
        c = np.asarray(by_turn[k])
        mean = c.mean() if abs(c.mean()) >= 5e-5 else 0.0  # no "-0.0000" from rounding noise
        lines.append(f"{k:>4}  {len(c):>6}  {mean:>11.4f}  {c.min():>8.3f}  {c.max():>8.3f}"
                     f"  {np.mean(c > 0):>8.1%}")
    return "\n".join(lines)


def cmd_credit(args) -> int:
    import jax

    from jaxrl_agent import estimators
    from jaxrl_agent.rollout.records import RecordError, pack_records
    from jaxrl_agent.train.inputs import attach_env_inputs

    params = _parse_sets(args.set)
    staged = list(args.shaping or []) + list(args.then or [])
    twice = sorted({n for n in staged if staged.count(n) > 1})
    if twice:
        raise CliError(f"stage(s) {twice} given twice: --set STAGE.key cannot tell the copies "
                       f"apart; compose them in Python (estimators.Pipeline) instead")
    stage_params = {name: {} for name in staged}
    for key in [k for k in params if "." in k]:
        stage, hp = key.split(".", 1)
        if stage not in stage_params:
            raise CliError(f"--set {key}=...: {stage!r} is not a --shaping or --then stage "
                           f"(stages: {', '.join(staged) or 'none'}); plain keys go to the "
                           f"estimator")
        stage_params[stage][hp] = params.pop(key)
    try:
        spec = estimators.spec(args.estimator, "estimator")
        params = spec.canonical(params)
        estimators.check_hyper_params(args.estimator, params)
        pipe = estimators.Pipeline.build(
            args.estimator, params, shaping=[(n, stage_params[n]) for n in args.shaping or []],
            then=[(n, stage_params[n]) for n in args.then or []])
    except ValueError as e:
        raise CliError(str(e)) from None
    check_output_path(args.out, [args.rollouts])
    records, lines = read_records(args.rollouts)
    import warnings

    from jaxrl_agent.rollout.records import UnknownFieldWarning, unknown_fields
    for i, key, hint in unknown_fields(records):  # said with the file's line numbers
        msg = (f"{args.rollouts}:{lines[i]}: unknown field {key!r}"
               + (f" (did you mean {hint!r}?)" if hint else "") + "; it is not read")
        if args.strict:
            raise CliError(msg + " (--strict)")
        print(f"warning: {msg}", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnknownFieldWarning)  # said above
            batch, index = pack_records(attach_env_inputs(records, estimators.reads(pipe)),
                                        layout=args.layout)
    except RecordError as e:
        raise CliError(f"{args.rollouts}:{lines[e.index]}: {e.detail}") from None
    except ValueError as e:
        raise CliError(f"{args.rollouts}: {e}") from None
    print(f"read {len(records)} rollouts from {args.rollouts}: {len(set(index.task_index))} tasks, "
          f"layout {args.layout}, padded to N={batch.num_traj} K={batch.num_turns} "
          f"R={batch.num_rows} T={batch.row_len}", file=sys.stderr)
    state = pipe.init(len(index.task_index))
    start = time.perf_counter()
    try:
        pipe.check(batch, state)
        adv, _ = jax.jit(pipe.apply)(batch, state)
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    token = np.asarray(adv.token)
    if not np.isfinite(token).all():  # a bug if it ever happens: refuse to write garbage
        raise CliError(f"{args.estimator} produced non-finite credit; nothing was written")
    elapsed = time.perf_counter() - start
    hp = {**spec.hyper_params, **params}
    what = f"estimator {args.estimator} ({', '.join(f'{k}={v}' for k, v in hp.items())})"
    if staged:
        what = " -> ".join(list(args.shaping or []) + [what] + list(args.then or []))
    print(f"{what}: {elapsed:.2f} s including compilation", file=sys.stderr)
    rows = list(credit_rows(records, index, batch, adv))
    _write_atomic(args.out, (json.dumps(r) for r in rows))
    print(summary_table(rows))
    print(f"wrote per-turn and per-token credit of {len(rows)} rollouts to {args.out}",
          file=sys.stderr)
    return 0


def cmd_sources(args) -> int:
    """``jaxrl-agent estimators --sources``: for every credit method and auxiliary loss, the
    inputs it reads with its default settings and the source that supplies each in training
    (``train.inputs``)."""
    from jaxrl_agent import run_checks
    from jaxrl_agent.train.inputs import LOOP_INPUTS, SOURCES

    reports = run_checks.builtin_reports()
    rows, needs_plugin = [], []
    kinds = [(k, e.name) for k in ("estimator", "shaping", "transform")
             for e in registry_entries(k)] + [("loss", n) for n in run_checks.aux_loss_names()]
    for kind, name in kinds:
        fields = run_checks.method_reads(kind, name)
        parts = []
        for field, _ in fields:
            if field in LOOP_INPUTS:
                src = LOOP_INPUTS[field].source
                key = SOURCES[src][1]
                parts.append(f"{field} <- {src}" + ("" if key.startswith("(") else f" ({key})"))
            elif field in reports:
                parts.append(f"{field} <- env (reported by {', '.join(reports[field])})")
            else:
                parts.append(f"{field} <- env report or signal plug-in (none built in)")
                if name not in needs_plugin:
                    needs_plugin.append(name)
        label = "loss.aux" if kind == "loss" else kind
        rows.append(f"{name:<20} {label:<10} " + ("; ".join(parts) or "the core batch only"))
    print("\n".join(rows))
    print(f"\n{len(kinds)} methods; {len(kinds) - len(needs_plugin)} read only inputs a built-in "
          f"source supplies; {len(needs_plugin)} read a field that an environment's "
          f"Env.reports or a signal plug-in (signals:) must supply: {', '.join(needs_plugin)}")
    return 0


def registry_entries(kind: str):
    from jaxrl_agent import envs, estimators, losses, registry
    del envs, estimators, losses  # imported for their registrations
    return registry.entries(kind)


def cmd_estimators(args) -> int:
    from jaxrl_agent import envs, estimators, losses, registry
    if getattr(args, "sources", False):
        return cmd_sources(args)

    titles = {"estimator": "estimators (--estimator)",
              "shaping": "reward shaping, before the estimator (--shaping)",
              "transform": "credit transforms, after the estimator (--then)",
              "loss": "losses (loss.policy, loss.kl_estimator, auxiliary)",
              "env": "environments (env.name)"}
    del envs, estimators, losses  # imported for their registrations
    for kind, title in titles.items():
        print(f"# {title}")
        for entry in registry.entries(kind):
            hp = ", ".join(f"{k} (required)" if v is inspect.Parameter.empty else f"{k}={v!r}"
                           for k, v in entry.hyper_params.items()
                           if kind != "loss" or k not in ("agg", "agg_constant"))
            doc = ((entry.fn.__doc__ or "").strip().splitlines() or [""])[0]
            notes = [f"reads {', '.join(entry.reads)}"] if isinstance(entry.reads, tuple) and \
                entry.reads else (["reads inputs by its settings"] if callable(entry.reads) else [])
            notes += ["stateful"] * entry.stateful
            notes += [f"from {entry.origin}"] * (not entry.origin.startswith("jaxrl_agent."))
            extra = f" [{'; '.join(notes)}]" if notes else ""
            also = f" (also: {', '.join(entry.aliases)})" if entry.aliases else ""
            print(f"{entry.name:<22} {doc}\n{'':<22} {hp}{extra}{also}")
    return 0


def cmd_lab(args) -> int:
    from jaxrl_agent.lab import arms as lab_arms, report, tasks

    if args.list:
        for name, (_, desc) in lab_arms.NAMED_ARMS.items():
            print(f"{name:<12} {desc}")
        print(lab_arms.known_arms())
        return 0

    def ints(text, flag):
        try:
            vals = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise CliError(f"{flag} {text!r}: expected comma-separated integers") from None
        if not vals or min(vals) < 1:
            raise CliError(f"{flag} {text!r}: expected positive integers")
        return vals

    if args.seeds < 1 or args.steps < 0:
        raise CliError("--seeds must be >= 1 and --steps >= 0")
    group_sizes = ints(args.group_sizes, "--group-sizes")
    num_groups = ints(args.num_groups, "--num-groups")
    try:
        task = tasks.make_task(args.task, **_parse_sets(args.task_set))
        arms = lab_arms.parse_arms(args.estimators)
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    print(f"task {task.describe()}", file=sys.stderr)
    start = time.perf_counter()
    try:
        result = report.run_lab(task, arms, seeds=args.seeds, group_sizes=group_sizes,
                                num_groups=num_groups, steps=args.steps, lr=args.lr,
                                seed=args.seed, log=lambda m: print(m, file=sys.stderr))
    except ValueError as e:
        raise CliError(str(e)) from None
    print(report.format_table(result))
    stem = os.path.join(args.out, f"lab_{task.name}")
    report.write_json(result, stem + ".json")
    written = [stem + ".json"]
    if not args.no_plots:
        written.append(report.plot_correlation_by_turn(result, stem + "_correlation.png"))
        if args.steps > 0:
            from jaxrl_agent.lab.mdp import optimal_return
            written.append(report.plot_learning_curves(
                result["arms"], stem + "_learning.png",
                title=f"{task.name}: exact success, mean and 95% CI over {args.seeds} seeds",
                optimum=float(optimal_return(task.mdp))))
    print(f"wrote {', '.join(written)} ({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    import shutil

    import numpy as np

    from jaxrl_agent.models import load_hf, save_hf, to_hf_tensors
    from jaxrl_agent.models.tokenizer import TOKENIZER_FILES

    start = time.perf_counter()
    try:
        model, config = load_hf(args.src, dtype=args.dtype)
    except (OSError, ValueError) as e:
        raise CliError(f"{args.src}: {e}") from None
    tensors = to_hf_tensors(model)
    n_params = sum(int(np.prod(x.shape)) for x in tensors.values())
    print(f"loaded {args.src}: {config.family}, {config.num_layers} layers, hidden "
          f"{config.hidden_size}, {n_params:,} parameters, {config.dtype} "
          f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
    if os.path.abspath(args.src) == os.path.abspath(args.out):
        raise CliError("OUT_DIR must differ from HF_DIR")
    save_hf(model, config, args.out, max_shard_bytes=args.max_shard_bytes)
    copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(args.src, f))]
    for name in copied:
        shutil.copy2(os.path.join(args.src, name), os.path.join(args.out, name))
    back, _ = load_hf(args.out)
    again = to_hf_tensors(back)
    same = all(np.array_equal(tensors[k], again[k]) for k in tensors)
    if not same:
        raise CliError(f"{args.out}: the written checkpoint does not read back identically")
    print(f"wrote {args.out} (HF format{', sharded' if args.max_shard_bytes else ''}; "
          f"tokenizer files: {', '.join(copied) or 'none'}); read back identically",
          file=sys.stderr)
    return 0


def cmd_sample(args) -> int:
    from jaxrl_agent.models import load_model_folder, load_tokenizer
    from jaxrl_agent.sampling import JaxSampler, SamplingParams

    try:
        model, config, tok_folder = load_model_folder(args.model, dtype=args.dtype)
    except (OSError, ValueError, KeyError) as e:
        raise CliError(f"{args.model}: {e}") from None
    tok = None
    if args.prompt_ids is not None:
        try:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise CliError("--prompt-ids must be comma-separated integers") from None
    else:
        try:
            tok = load_tokenizer(tok_folder)
        except Exception as e:  # noqa: BLE001 - missing files, missing packages, bad JSON
            raise CliError(f"{tok_folder}: cannot load a tokenizer ({e}); pass --prompt-ids "
                           f"instead") from None
        if args.raw:
            prompt = tok.encode(args.prompt)
        else:
            try:
                prompt = tok.apply_chat_template([{"role": "user", "content": args.prompt}])
            except ValueError as e:
                raise CliError(f"{e} (use --raw to encode the prompt as plain text)") from None
    stop = tuple(args.stop_ids) if args.stop_ids else tuple(
        x for x in (tok.eos_token_id if tok else config.eos_token_id,) if x is not None)
    params = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                             max_new_tokens=args.max_new_tokens, stop_token_ids=stop,
                             seed=args.seed + i) for i in range(args.num_samples)]
    sampler = JaxSampler(model)
    start = time.perf_counter()
    try:
        outs = sampler.generate([prompt] * args.num_samples, params)
    except ValueError as e:
        raise CliError(str(e)) from None
    elapsed = time.perf_counter() - start
    for i, o in enumerate(outs):
        text = tok.decode(o.token_ids) if tok else ""
        print(json.dumps({"sample": i, "text": text, "token_ids": list(o.token_ids),
                          "logprob": _round(sum(o.logprobs)),
                          "finish_reason": o.finish_reason}))
    n_tok = sum(len(o.token_ids) for o in outs)
    print(f"{len(outs)} samples, {n_tok} tokens in {elapsed:.2f} s including compilation "
          f"(prompt: {len(prompt)} tokens)", file=sys.stderr)
    return 0


def _train_config(args):
    """The run's config, not yet validated (validation traces JAX functions, which must wait
    for the multi-process start): CONFIG (or the defaults) + --set; with --resume and no
    CONFIG, the run's own saved config + --set (a value left out keeps the run's, not the
    default). ``--import`` modules are added to the config's ``imports``."""
    return _with_imports(_train_config_of(args), args.imports)


def _with_imports(cfg, imports):
    """The run's plug-ins plus those given with --import (recorded in the run's config)."""
    from jaxrl_agent import config as config_lib
    from jaxrl_agent import run_checks

    extra = [m for m in imports or () if m not in cfg.imports]
    if not extra:
        return cfg
    d = config_lib.to_dict(cfg)
    d["imports"] = list(cfg.imports) + extra
    return run_checks.from_dict(d)


def _train_config_of(args):
    from jaxrl_agent import config as config_lib
    from jaxrl_agent import run_checks
    from jaxrl_agent.train.rundir import find_run, run_config

    if args.resume is None:
        return run_checks.load(args.config, args.set or (), validate=False)
    if args.resume is not True:  # --resume RUN
        root = find_run(args.resume)
    else:  # the run the config names (default: runs/cpu_default)
        named = run_checks.load(args.config, args.set or (), validate=False)
        root = config_lib.run_dir(named)
        if not os.path.isfile(os.path.join(root, "config.yaml")):
            return named  # nothing to resume there: starts fresh
    if args.config is not None:  # the file states the values; the run keeps its location
        # resolved exactly as a fresh start resolves it (defaults that depend on the
        # environment, its files' folder, environment variables), so an unchanged file is an
        # unchanged config
        d = config_lib.to_dict(run_checks.load(args.config, args.set or (), validate=False))
        d["run"] = dict(d["run"], dir=root)
        return run_checks.from_dict(d)
    return run_config(root, args.set or ())


def cmd_train(args) -> int:
    from jaxrl_agent import config as config_lib
    from jaxrl_agent import run_checks

    cfg = _train_config(args)
    if args.print_config:
        print(yaml.safe_dump(config_lib.to_dict(run_checks.validate(cfg)), sort_keys=False))
        return 0
    from jaxrl_agent.sharding import multihost

    try:  # before anything touches a device: a multi-process job is assembled at backend start
        multihost.initialize(**dataclasses.asdict(cfg.distributed))
    except ValueError as e:
        raise CliError(str(e)) from None
    from jaxrl_agent.train.loop import Trainer

    trainer = Trainer(cfg, resume=args.resume is not None, progress=not args.quiet,
                      overwrite=args.overwrite)  # validates the config first
    import signal

    def on_term(signum, frame):  # a scheduler's SIGTERM: stop like Ctrl-C (checkpoint kept)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # a shell starts background jobs with SIGINT ignored; Ctrl-C / kill -INT should stop cleanly
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        trainer.run()
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_show(args) -> int:
    from jaxrl_agent.train.rundir import find_run

    folder = os.path.join(find_run(args.run), "rollouts")
    steps = sorted(int(n[5:-6]) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
                   if n.startswith("step_") and n.endswith(".jsonl") and n[5:-6].isdigit())
    if not steps:
        raise CliError(f"{folder}: no rollout samples (the run writes them from its first step "
                       f"on, metrics.rollout_samples per step)")
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        raise CliError(f"{folder}: no samples of step {step}; steps with samples: "
                       f"{steps[0]}..{steps[-1]} ({len(steps)} of them)")
    with open(os.path.join(folder, f"step_{step}.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        verdict = "success" if r.get("success") else "no success"
        err = f", env error: {r['env_error']}" if r.get("env_error") else ""
        print(f"== step {step}  task {r.get('task')}  group {r.get('group')}  outcome "
              f"{r.get('outcome', 0):.2f} ({verdict}{err})")
        for k, t in enumerate(r["turns"]):
            print(f"-- turn {k + 1}: reward {t['reward']:+.2f}  credit {t['credit']:+.3f}"
                  f"{'  (cut at max_new_tokens)' if t.get('finish_reason') == 'length' else ''}")
            obs = t["observation"]
            if len(obs) > args.chars:
                obs = "..." + obs[-args.chars:]
            print("  observation: " + obs.replace("\n", "\n  "))
            print("  reply:       " + t["reply"].replace("\n", "\n  "))
        print()
    return 0


def cmd_eval(args) -> int:
    from jaxrl_agent.train.loop import evaluate_run

    res = evaluate_run(args.run, step=args.step, num_tasks=args.tasks, split=args.split,
                       overrides=args.set or ())
    print(json.dumps(res))
    return 0


def cmd_plan(args) -> int:
    """Compiles the run's train step (and the JAX sampler's prefill and decode step) ahead of
    time for a topology (shapes only) and prints the per-device memory, compile time and
    collectives; exit 1 when the run does not fit the chip's HBM."""
    from jaxrl_agent import run_checks

    cfg = _with_imports(run_checks.load(args.config, args.set or (), validate=False),
                        args.imports)
    from jaxrl_agent.train import plan as plan_lib

    source = args.config or "(built-in default config)"
    if args.hf_config:
        source += f" with {args.hf_config}"
    try:
        if args.fit:
            p, tried = plan_lib.fit_micro_batches(cfg, args.topology, hf_config=args.hf_config,
                                                  log=lambda line: print(line, flush=True))
            if p is None:
                raise CliError(f"no trainer.micro_batches fits {args.topology}: the largest, "
                               f"{tried[-1][0]}, needs {tried[-1][1] / 2 ** 30:.2f} GiB per "
                               "device; raise mesh.fsdp / mesh.tensor, lower "
                               "rollout.max_context_tokens, or use a larger slice")
            source += f" with trainer.micro_batches={p.step['micro_batches']} (--fit)"
        else:
            p = plan_lib.plan_run(cfg, args.topology, hf_config=args.hf_config)
    except plan_lib.PlanError as e:
        raise CliError(str(e)) from None
    print(plan_lib.format_plan(p, source))
    return 1 if p.run_fits is False else 0


def build_parser() -> argparse.ArgumentParser:
    from jaxrl_agent import __version__

    p = argparse.ArgumentParser(prog="jaxrl-agent", description=__doc__.strip().splitlines()[0])
    p.add_argument("--version", action="version", version=f"jaxrl-agent {__version__}")
    # every command takes --import (also after the command name)
    plug = argparse.ArgumentParser(add_help=False)
    plug.add_argument("--import", dest="imports", action="append", default=None,
                      metavar="MODULE",
                      help="a module that registers your own estimators, stages, losses or "
                           "environments (a dotted name or a .py path; repeatable; recorded "
                           "with a training run)")
    sub = p.add_subparsers(dest="command", required=True)
    _add_parser = sub.add_parser
    sub.add_parser = lambda *a, **k: _add_parser(*a, parents=[plug], **k)  # noqa: E731
    t = sub.add_parser("train", help="multi-turn agentic RL (default: the built-in CPU run)",
                       description="Trains a policy with RL on a multi-turn environment. "
                                   "Without CONFIG: the built-in CPU default (tiny model, "
                                   "supervised warm-up, GiGPO on the grid world).")
    t.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml",
                   help="a YAML run config (see configs/); default: the built-in CPU default")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set optimizer.lr=1e-5 (repeatable)")
    t.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN",
                   help="continue a run from its newest readable checkpoint, with the run's "
                        "own config (--set may change steps, evaluation, logging, checkpoint "
                        "cadence and the device layout); RUN is a run directory or name "
                        "(default: the run the config names, runs/<name>)")
    t.add_argument("--overwrite", action="store_true",
                   help="start fresh in a run directory that holds an earlier run, deleting "
                        "its config, checkpoints, metrics and exported models")
    t.add_argument("--quiet", action="store_true", help="no progress output")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit")
    t.set_defaults(func=cmd_train)
    sh = sub.add_parser("show", help="print a run's sampled conversations of one step (what "
                                     "the model said, the rewards and the credit)")
    sh.add_argument("run", metavar="RUN",
                    help="a run directory (e.g. runs/cpu_default) or a run name")
    sh.add_argument("--step", type=int, default=None, help="default: the newest step")
    sh.add_argument("--chars", type=int, default=400,
                    help="characters of each observation shown (its end)")
    sh.set_defaults(func=cmd_show)
    ev = sub.add_parser("eval", help="held-out evaluation of a run's checkpoint")
    ev.add_argument("run", metavar="RUN",
                    help="a run directory (e.g. runs/cpu_default) or a run name")
    ev.add_argument("--step", type=int, default=None, help="default: the newest checkpoint")
    ev.add_argument("--tasks", type=int, default=None,
                    help="number of tasks (default: the run's trainer.eval_tasks)")
    ev.add_argument("--split", choices=("test", "train"), default="test")
    ev.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                    help="override a value of the run's config (e.g. env.kwargs)")
    ev.set_defaults(func=cmd_eval)
    c = sub.add_parser("credit", help="assign credit to logged rollouts (offline)",
                       description="Reads rollout records (JSONL), computes advantages with "
                                   "an estimator, writes per-turn and per-token credit.")
    c.add_argument("rollouts", metavar="ROLLOUTS.jsonl")
    c.add_argument("--estimator", required=True, help="estimator name (see `jaxrl-agent "
                                                      "estimators`)")
    c.add_argument("--shaping", action="append", metavar="NAME",
                   help="reward shaping applied before the estimator, e.g. --shaping pbrs "
                        "(repeatable, in order)")
    c.add_argument("--then", action="append", metavar="NAME",
                   help="credit transform applied to the estimator's advantages, e.g. "
                        "--then reallocate (repeatable, in order)")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="hyper-parameter: --set gamma=0.99 for the estimator, --set "
                        "STAGE.KEY=VALUE for a --shaping/--then stage (repeatable)")
    c.add_argument("--layout", choices=("concatenated", "per_step"), default="concatenated")
    c.add_argument("--out", required=True, metavar="OUT.jsonl")
    c.add_argument("--strict", action="store_true",
                   help="an unknown record or turn field is an error (default: a warning)")
    c.set_defaults(func=cmd_credit)
    e = sub.add_parser("estimators", help="list the registered estimators, stages, losses and "
                                          "environments")
    e.add_argument("--sources", action="store_true",
                   help="for each credit method and auxiliary loss, the inputs it reads and "
                        "the source that supplies each in training")
    e.set_defaults(func=cmd_estimators)
    lab = sub.add_parser("lab", help="score and train credit estimators on tabular tasks with "
                                     "exact advantages",
                         description="The credit lab: samples rollouts of a tabular policy on "
                                     "a small MDP whose advantages are known exactly, scores "
                                     "each estimator's per-turn credit against them and trains "
                                     "the policy with it (PPO). Prints a table, writes a JSON "
                                     "and PNG plots.")
    lab.add_argument("--estimators", default="grpo,gigpo",
                     help="comma-separated arms: registered estimators (grpo, gigpo, ...), "
                          "compositions SHAPING:EST+TRANSFORM, or named arms (sparse, uniform, "
                          "targeted, shuffled, mc_minus_v, exact); see --list")
    lab.add_argument("--task", default="tree", choices=("tree", "gridworld", "chain",
                                                         "distractor"))
    lab.add_argument("--task-set", action="append", metavar="KEY=VALUE",
                     help="task parameter, e.g. --task-set exposed=3 for the chain "
                          "(repeatable)")
    lab.add_argument("--seeds", type=int, default=4, help="seeds per arm (default 4)")
    lab.add_argument("--group-sizes", default="8", metavar="G,...",
                     help="rollouts per group G to score at (default 8)")
    lab.add_argument("--num-groups", default="4", metavar="B,...",
                     help="groups per batch to score at (default 4); training uses the first "
                          "G and B")
    lab.add_argument("--steps", type=int, default=40,
                     help="training steps per seed (0: score only; default 40)")
    lab.add_argument("--lr", type=float, default=5.0,
                     help="SGD learning rate of the logits (credit is RMS-normalised per "
                          "batch; default 5)")
    lab.add_argument("--seed", type=int, default=0)
    lab.add_argument("--out", default="runs/lab", metavar="DIR",
                     help="where the JSON and plots go (default runs/lab)")
    lab.add_argument("--no-plots", action="store_true")
    lab.add_argument("--list", action="store_true", help="list the arms and exit")
    lab.set_defaults(func=cmd_lab)
    v = sub.add_parser("convert", help="load a Hugging Face checkpoint folder into the NNX "
                                      "model and write it back (optionally re-typed/sharded)")
    v.add_argument("src", metavar="HF_DIR")
    v.add_argument("out", metavar="OUT_DIR")
    v.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="parameter dtype (default: the checkpoint's)")
    v.add_argument("--max-shard-bytes", type=int, default=None,
                   help="write sharded safetensors with an index")
    v.set_defaults(func=cmd_convert)
    g = sub.add_parser("sample", help="sample completions from a Hugging Face checkpoint "
                                     "folder (or a PEFT LoRA adapter folder on its local "
                                     "base) with the JAX sampler")
    g.add_argument("model", metavar="HF_DIR")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat template applied unless --raw)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated")
    g.add_argument("--raw", action="store_true", help="encode --prompt as plain text")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--stop-ids", type=int, nargs="*", default=None,
                   help="stop token ids (default: the tokenizer's EOS)")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    g.set_defaults(func=cmd_sample)
    pl = sub.add_parser("plan", help="compile the train step for a device topology (TPU without "
                                     "a TPU) and print its memory per device",
                        description="Builds the run's model, optimizer state and train step "
                                    "from shapes only, lays them out on the config's mesh over "
                                    "the topology's devices and compiles the real train step: "
                                    "per-device parameters, optimizer state, temporaries, total "
                                    "against the chip's HBM, compile time and collectives. TPU "
                                    "topologies need the tpu-aot extra (libtpu), not a TPU. "
                                    "Exit status 1 when the step does not fit.")
    pl.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml",
                    help="a YAML run config (default: the built-in CPU default)")
    pl.add_argument("--topology", required=True, metavar="NAME",
                    help="cpu:N (host devices) or a TPU slice libtpu knows, e.g. v5e:2x2, "
                         "v5e:2x4, v5p:2x2x1, v4:2x2x4, v6e:2x4")
    pl.add_argument("--hf-config", default=None, metavar="NAME|PATH",
                    help="model shapes instead of model.hf_path's: a config.json, a folder "
                         "holding one (no weights needed), or a known name (qwen2.5-0.5b, "
                         "qwen2.5-1.5b, qwen3-1.7b, qwen2.5-7b, llama-3.1-8b)")
    pl.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                    help="override a config value, e.g. --set mesh.fsdp=8 (repeatable)")
    pl.add_argument("--fit", choices=("micro_batches",), default=None,
                    help="search the fewest trainer.micro_batches (from the config's up) whose "
                         "step fits the chip's HBM, one compile per candidate, and plan that")
    pl.set_defaults(func=cmd_plan)
    return p


def load_plugins(items) -> list:
    """``--import`` items imported (paths made absolute against the working directory, as a
    training run records them); ``CliError`` naming the one that fails."""
    from jaxrl_agent import config as config_lib
    from jaxrl_agent import registry

    items = config_lib.resolve_imports(items or [], os.getcwd())
    try:
        registry.load_imports(items)
    except ImportError as e:
        raise CliError(f"--import: {e}") from None
    return items


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.imports = load_plugins(getattr(args, "imports", None))
        return args.func(args)
    except CliError as e:
        print(f"jaxrl-agent {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except OSError as e:  # a path: missing, a directory, not readable or writable, disk full
        if getattr(e, "filename", None) is None:
            raise
        print(f"jaxrl-agent {args.command}: error: {e.filename}: {e.strerror or e}",
              file=sys.stderr)
        return 2
    except UnicodeDecodeError as e:
        print(f"jaxrl-agent {args.command}: error: a file is not UTF-8 text ({e.reason} at "
              f"byte {e.start})", file=sys.stderr)
        return 2
    except ValueError as e:  # config and input errors: no traceback
        from jaxrl_agent.config import ConfigError
        from jaxrl_agent.envs.tasks import TaskFileError
        from jaxrl_agent.rollout.chat import ChatError
        from jaxrl_agent.train.loop import EnvFailureError, StaleBatchError
        from jaxrl_agent.train.rundir import RunLockedError

        if not isinstance(e, (ConfigError, StaleBatchError, RunLockedError, EnvFailureError,
                              TaskFileError, ChatError)):
            raise
        print(f"jaxrl-agent {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # an optional extra that is not installed: say which
        if "jaxrl-agent[" not in str(e):
            raise
        print(f"jaxrl-agent {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from jaxrl_agent.sampling.vllm import WeightSyncError
        if not isinstance(e, WeightSyncError):
            raise
        print(f"jaxrl-agent {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
