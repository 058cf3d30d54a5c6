"""Writes examples/signal_rollouts.jsonl: 16 synthetic rollouts (4 tasks x 4) that carry every
signal the shaping, re-allocation and distillation methods read by default: teacher and
reference log-probs per action token, potentials and progress per turn (with the final value
per record), judge labels (roles, citations, verdicts, feedback), agent ids with
counterfactual and coalition values, rubric spans and a typed dependency graph (``edges``).

The numbers are random (seeded): the file shows the record format and lets every method run
from the command line, e.g.

    jaxrl-agent credit examples/signal_rollouts.jsonl --estimator grpo --then trial --out credit.jsonl
    jaxrl-agent credit examples/signal_rollouts.jsonl --shaping pbrs --estimator returns --out credit.jsonl

    python examples/make_signal_rollouts.py [OUT.jsonl]
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.signals import signal_records  # noqa: E402


def _rounded(x):
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


def main(out=None):
    out = out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "signal_rollouts.jsonl")
    recs = signal_records(seed=0)
    with open(out, "w") as f:
        for r in recs:
            f.write(json.dumps(_rounded(r)) + "\n")
    print(f"wrote {len(recs)} rollouts to {out}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
