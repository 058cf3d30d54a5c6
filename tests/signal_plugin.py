"""A signal plug-in for the tests (registry kind ``signal``): it writes every judge, verifier,
rubric and environment field of ``tests.signals.add_signals`` into finished trajectories, so
one run can train every registered method. The fields the train step makes itself (teacher and
reference log-probs, entropies) are left to the step."""

from __future__ import annotations

import copy
import zlib

import numpy as np

from jaxrl_agent import register
from tests.signals import add_signals

#: made by the train step, never by a plug-in
STEP_FIELDS = ("teacher_logprobs", "entropy", "ref_logprobs")
NEGATIVES = 2  # credit's negatives: the teacher's log-probs under 2 other inputs


def _fields() -> dict:
    rec = add_signals(np.random.default_rng(0), {"turns": [{"action": [1]}]})
    out = {k: "turn" for k in rec["turns"][0]["turn_extras"]}
    out.update({k: "token" for k in rec["turns"][0]["token_extras"] if k not in STEP_FIELDS})
    out.update({k: "traj" if not isinstance(v, list) else f"traj[{len(v)}]"
                for k, v in rec["traj_extras"].items()})
    out.update(other_logprobs="token", return_gap="traj", edges="edges",
               negative_logprobs=f"token[{NEGATIVES}]")
    return out


FIELDS = _fields()


@register("every_signal", kind="signal", provides=FIELDS)
def every_signal(records, *, seed: int = 0):
    """Every field of ``FIELDS`` for each record, drawn from a generator seeded by the record's
    tokens (the same record always gets the same signals)."""
    out = []
    for rec in records:
        key = zlib.crc32(repr([t.get("action") for t in rec["turns"]]).encode()) + seed
        filled = add_signals(np.random.default_rng(key), copy.deepcopy(
            {"turns": [{"action": t["action"], "logprobs": t.get("logprobs")}
                       for t in rec["turns"]]}))
        k = len(rec["turns"])
        other = [[min(x + 0.1, 0.0) for x in t["token_extras"]["contrast_logprobs"]]
                 for t in filled["turns"]]
        filled["traj_extras"]["return_gap"] = float(filled["traj_extras"]["score"] - 0.5)
        out.append({
            "edges": [[j, j + 1, 0] for j in range(k - 1)],
            "turn_extras": {k: [t["turn_extras"][k] for t in filled["turns"]]
                            for k, lvl in FIELDS.items() if lvl == "turn"},
            "token_extras": {**{f: [t["token_extras"][f] for t in filled["turns"]]
                                for f, lvl in FIELDS.items()
                                if lvl == "token" and f != "other_logprobs"},
                             "other_logprobs": other,
                             "negative_logprobs": [[[x - 0.3 * (m + 1) for m in range(NEGATIVES)]
                                                    for x in o] for o in other]},
            "traj_extras": {f: filled["traj_extras"][f]
                            for f, lvl in FIELDS.items() if lvl.startswith("traj")}})
    return out
