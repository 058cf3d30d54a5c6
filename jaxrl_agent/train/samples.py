"""A step's trajectories as text and credit, for ``jaxrl-agent show``, TensorBoard's text tab
and the credit picture: a few conversations with their per-turn credit.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxrl_agent import segments

__all__ = ["SAMPLE_OBS_CHARS", "credit_trajectories", "sample_conversations", "samples_markdown",
           "turn_credit"]


def _printable(text: str) -> str:
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in text) or "''"


#: characters of an observation kept in a rollout sample (its end: the newest text)
SAMPLE_OBS_CHARS = 2000


def turn_credit(batch, advantages):
    """``[N, K]`` per-turn credit of a step: the estimator's turn-level credit when it has
    one, else the token-mean over each turn (a device array; jit-safe on every process)."""
    if advantages.turn is not None:
        return advantages.turn
    return segments.token_to_turn(jnp.asarray(advantages.token), batch, reduce="mean")


def sample_conversations(records, turn, codec, limit: int = 4) -> list[dict]:
    """The trajectories ``credit_trajectories`` shows (a mixed group's best and worst, then
    one of each other group), as text: per turn the observation (its last
    ``SAMPLE_OBS_CHARS`` characters, decoded), the reply as sampled, the reward, the turn's
    credit (``turn``: ``turn_credit`` on the host) and why the reply ended (``stop`` or
    ``length``: cut at ``max_new_tokens``)."""
    out = []
    for i, credit in _credit_rows(records, np.asarray(turn), limit):
        rec = records[i]
        turns = []
        for k, t in enumerate(rec["turns"]):
            obs = codec.decode(t["observation"]) if t.get("observation") else ""
            turns.append({"observation": obs[-SAMPLE_OBS_CHARS:], "reply": t.get("action_text",
                                                                            codec.decode(t["action"])),
                          "reward": float(t["reward"]), "credit": float(credit[k]),
                          "finish_reason": t.get("finish_reason")})
        out.append({"task": rec.get("task"), "group": rec.get("group"),
                    "outcome": float(rec.get("outcome", 0.0)),
                    "success": bool(rec.get("success", False)),
                    "env_error": rec.get("env_error"), "turns": turns})
    return out


def samples_markdown(rows: list[dict], obs_chars: int = 300) -> str:
    """``sample_conversations``' rows as markdown (TensorBoard's Text tab): per trajectory a
    heading with the task and outcome, per turn the observation's end, the reply, the reward
    and the credit."""
    out = []
    for r in rows:
        out.append(f"### {r.get('task')}: outcome {r.get('outcome', 0):.2f}"
                   + (f" (env error: {r['env_error']})" if r.get("env_error") else ""))
        for k, t in enumerate(r["turns"]):
            obs = t["observation"][-obs_chars:].replace("\n", " ")
            cut = " (cut at max_new_tokens)" if t.get("finish_reason") == "length" else ""
            out.append(f"{k + 1}. reward {t['reward']:+.2f}, credit {t['credit']:+.3f}{cut}  \n"
                       f"   observation: `{obs}`  \n   reply: `{t['reply']}`")
    return "\n\n".join(out)


def _credit_rows(records, turn, limit: int) -> list:
    """``[(record index, per-turn credit)]`` of the trajectories ``credit_trajectories``
    shows (``turn``: ``turn_credit`` on the host): ``limit`` of them, or every record when
    there are fewer."""
    groups: dict = {}
    for i, rec in enumerate(records):
        groups.setdefault(rec["group"], []).append(i)
    score = lambda i: records[i].get("outcome", 0.0)  # noqa: E731
    mixed = [g for g, idx in groups.items() if len({score(i) for i in idx}) > 1]
    picked = []
    if mixed:
        idx = groups[mixed[0]]
        picked += [max(idx, key=score), min(idx, key=score)]
    picked += [idx[0] for g, idx in groups.items() if not mixed or g != mixed[0]]
    picked += range(len(records))  # fewer groups than ``limit``: the rest in order
    return [(i, turn[i]) for i in list(dict.fromkeys(picked))[:limit]]


def credit_trajectories(records, turn, limit: int = 4) -> list[dict]:
    """Per-turn credit of the first few trajectories of a step, for ``plots.credit_picture``
    (``turn``: ``turn_credit`` on the host, row i for ``records[i]``). Shown is where credit
    is decided: the best and the worst rollout of a group with mixed outcomes, then one
    rollout of each of a few other groups (all-equal groups get 0)."""
    out = []
    for i, credit in _credit_rows(records, turn, limit):
        rec = records[i]
        out.append({"title": f"{rec['task'][:40]}  success={rec.get('success', 0):.0f}",
                    "turns": [{"action": _printable(t.get("action_text", "?")),
                               "reward": t["reward"],
                               "credit": float(credit[k])} for k, t in enumerate(rec["turns"])]})
    return out

