"""Regenerates the example rollout files (deterministic): python examples/make_rollouts.py

A toy calculator task: the agent sees "a+b=?", may call a calculator tool (one turn, whose
observation is the tool's answer) and then answers. Success (outcome 1) needs the right answer;
a malformed tool call costs -0.1. Token ids come from a tiny word vocabulary.
"""

import json
import os
import random

VOCAB = {w: i for i, w in enumerate(
    "<bos> task : + = ? call calc ( ) result answer error think ok".split() +
    [str(d) for d in range(10)])}


def toks(text):
    return [VOCAB[w] for w in text.split()]


def digits(n):
    return " ".join(str(n))


def rollout(rng, task_id, a, b, with_values):
    prompt = f"<bos> task : {digits(a)} + {digits(b)} = ?"
    turns, success = [], False
    obs = prompt
    for k in range(3):
        last = k == 2
        if not last and rng.random() < 0.6:  # call the tool
            bad = rng.random() < 0.25
            act = f"call calc ( {digits(a)} + {'(' if bad else digits(b)} )"
            reply = "error" if bad else f"result {digits(a + b)}"
            turns.append({"observation": toks(obs), "action": toks(act),
                          "reward": -0.1 if bad else 0.0, "state_key": f"{task_id}/tool{k}"})
            obs = reply
            continue
        knows = obs.startswith("result")
        guess = a + b if (knows and rng.random() < 0.9) or rng.random() < 0.3 else a + b + 1
        success = guess == a + b
        turns.append({"observation": toks(obs), "action": toks(f"answer {digits(guess)}"),
                      "reward": 1.0 if success else 0.0, "state_key": f"{task_id}/answer"})
        break
    for t in turns:
        t["logprobs"] = [round(-rng.uniform(0.01, 2.0), 4) for _ in t["action"]]
        if with_values:
            t["value"] = round(rng.uniform(0.2, 0.8), 3)
    return {"group": task_id, "task": task_id, "outcome": 1.0 if success else 0.0, "turns": turns}


def write(path, with_values):
    rng = random.Random(0)
    tasks = [("add-17-25", 17, 25), ("add-8-5", 8, 5), ("add-123-9", 123, 9)]
    with open(path, "w") as f:
        for task_id, a, b in tasks:
            for _ in range(4):
                f.write(json.dumps(rollout(rng, task_id, a, b, with_values)) + "\n")


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    write(os.path.join(here, "rollouts.jsonl"), with_values=False)
    write(os.path.join(here, "rollouts_with_values.jsonl"), with_values=True)
