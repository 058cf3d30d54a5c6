"""The ``jaxrl-agent`` command line.

  jaxrl-agent credit ROLLOUTS.jsonl --estimator NAME [--set key=value ...] [--layout ...] --out OUT
  jaxrl-agent estimators
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import yaml


class CliError(Exception):
    """An error the user can fix; printed without a traceback, exit status 2."""


def _parse_sets(items):
    params = {}
    for item in items or []:
        if "=" not in item:
            raise CliError(f"--set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        try:
            params[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise CliError(f"--set {item!r}: cannot parse the value ({e})") from None
    return params


def read_records(path: str):
    """Reads a JSONL file of rollout records; returns (records, line number of each record)."""
    if not os.path.exists(path):
        raise CliError(f"{path}: no such file")
    records, lines = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise CliError(f"{path}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
            lines.append(lineno)
    if not records:
        raise CliError(f"{path}: no rollout records (the file is empty)")
    return records, lines


def _write_atomic(path: str, lines) -> None:
    """Writes all lines to a temporary file beside ``path``, then renames it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".jsonl", dir=directory)
    try:
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
    from jaxrl_agent import estimators
    from jaxrl_agent.batch import RecordError, pack_records

    params = _parse_sets(args.set)
    try:
        spec = estimators.spec(args.estimator)
        estimators.check_hyper_params(args.estimator, params)
    except ValueError as e:
        raise CliError(str(e)) from None
    records, lines = read_records(args.rollouts)
    try:
        batch, index = pack_records(records, layout=args.layout)
    except RecordError as e:
        raise CliError(f"{args.rollouts}:{lines[e.index]}: {e.detail}") from None
    except ValueError as e:
        raise CliError(f"{args.rollouts}: {e}") from None
    print(f"read {len(records)} rollouts from {args.rollouts}: {len(set(index.task_index))} tasks, "
          f"layout {args.layout}, padded to N={batch.num_traj} K={batch.num_turns} "
          f"R={batch.num_rows} T={batch.row_len}", file=sys.stderr)
    state = spec.init_state(len(index.task_index)) if spec.stateful else None
    start = time.perf_counter()
    try:
        out = estimators.compute(args.estimator, batch, state=state, validate=False, **params)
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    adv = out[0] if spec.stateful else out
    token = np.asarray(adv.token)
    if not np.isfinite(token).all():  # a bug if it ever happens: refuse to write garbage
        raise CliError(f"{args.estimator} produced non-finite credit; nothing was written")
    elapsed = time.perf_counter() - start
    hp = {**spec.hyper_params, **params}
    print(f"estimator {args.estimator} ({', '.join(f'{k}={v}' for k, v in hp.items())}): "
          f"{elapsed:.2f} s including compilation", file=sys.stderr)
    rows = list(credit_rows(records, index, batch, adv))
    _write_atomic(args.out, (json.dumps(r) for r in rows))
    print(summary_table(rows))
    print(f"wrote per-turn and per-token credit of {len(rows)} rollouts to {args.out}",
          file=sys.stderr)
    return 0


def cmd_estimators(args) -> int:
    from jaxrl_agent import estimators

    for name in estimators.names():
        spec = estimators.spec(name)
        hp = ", ".join(f"{k}={v!r}" for k, v in spec.hyper_params.items())
        doc = (spec.fn.__doc__ or "").strip().splitlines()[0]
        print(f"{name:<22} {doc}\n{'':<22} {hp}{' [stateful]' if spec.stateful else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jaxrl_agent import __version__

    p = argparse.ArgumentParser(prog="jaxrl-agent", description=__doc__.strip().splitlines()[0])
    p.add_argument("--version", action="version", version=f"jaxrl-agent {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("credit", help="assign credit to logged rollouts (offline)",
                       description="Reads rollout records (JSONL), computes advantages with "
                                   "an estimator, writes per-turn and per-token credit.")
    c.add_argument("rollouts", metavar="ROLLOUTS.jsonl")
    c.add_argument("--estimator", required=True, help="estimator name (see `jaxrl-agent "
                                                      "estimators`)")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="estimator hyper-parameter, e.g. --set gamma=0.99 (repeatable)")
    c.add_argument("--layout", choices=("concatenated", "per_step"), default="concatenated")
    c.add_argument("--out", required=True, metavar="OUT.jsonl")
    c.set_defaults(func=cmd_credit)
    e = sub.add_parser("estimators", help="list the registered estimators")
    e.set_defaults(func=cmd_estimators)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"jaxrl-agent {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
