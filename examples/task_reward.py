"""The reward function of ``examples/tasks.jsonl``: ``reward: examples/task_reward.py:score``.

``score(task, messages)`` is called after every agent turn with the task's line (a dict) and the
conversation so far (the agent's last message last). It compares the agent's last message with
the task's ``answer``: numbers by value (``12``, ``12.0`` and ``The answer is 12.`` all match
``"12"``), other answers as whole words, case-insensitively.

- Right: reward 1, the episode ends.
- Wrong, and the task has a ``hint`` and turns left: reward 0 and the hint as the next user
  message (the episode goes on; a task's ``max_turns`` bounds the retries).
- Wrong otherwise: reward 0, the episode ends.
- An empty reply: reward -0.1 and counted as an invalid action.
"""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def is_correct(reply: str, answer) -> bool:
    reply = reply.strip().lower()
    answer = str(answer).strip().lower()
    if NUMBER.fullmatch(answer):
        found = NUMBER.findall(reply)
        return bool(found) and float(found[-1]) == float(answer)
    return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", reply) is not None


def score(task: dict, messages: list) -> float | dict:
    reply = messages[-1]["content"]
    if not reply.strip():
        return {"reward": -0.1, "info": {"invalid_action": True}}
    if is_correct(reply, task["answer"]):
        return 1.0
    turns = sum(m["role"] == "assistant" for m in messages)
    if task.get("hint") and turns < task.get("max_turns", 1):
        return {"reward": 0.0, "observation": f"Not quite. Hint: {task['hint']} Try again."}
    return 0.0
