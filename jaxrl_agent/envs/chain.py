"""A synthetic C-step prerequisite chain with a configurable verifier information density.

A task is a sequence of ``C`` clues (letters ``a..``) and a set of ``k = round(V_d * C)``
revealed step indices (chosen per task). At step ``j`` the observation shows the clue::

    step 2/4 clue c

and the correct action is the word the (fixed, global) codebook maps the clue to:
``a->red b->green c->blue d->gold e->pink f->gray`` (the first ``num_words`` of them). The policy
has to learn the codebook from rewards alone.

Semantics (chosen for estimator studies): the chain always runs all ``C`` steps (a mistake does
not end the episode, so the episode length leaks nothing); success means every step was correct.
Rewards: a revealed step pays ``step_reward`` (default ``1/C``) when correct and 0 otherwise; an
unrevealed step pays 0; the last step additionally pays ``outcome_reward`` (default 1.0) on
success. So ``V_d = k/C`` is the fraction of the causal chain whose correctness the verifier
exposes (the verifier-information-density setting). ``info`` carries ``step_correct`` (bool) and
``revealed`` (bool) for every valid step and ``num_correct`` and ``revealed_steps`` on the last
one. An unknown word is an invalid action (no step is consumed, ``invalid_penalty``);
``max_turns`` defaults to ``C + 2``.
``state_key = "chain:<clues>|<revealed bits>|<step>|<prefix correctness bits>"``.
"""

from __future__ import annotations

from jaxrl_agent.envs.base import Env, Task, register, split_of

WORDS = ("red", "green", "blue", "gold", "pink", "gray")
CLUES = "abcdef"


class Chain(Env):
    family = "chain"

    def __init__(self, length: int = 4, num_words: int = 4, density: float = 0.5,
                 step_reward: float | None = None, outcome_reward: float = 1.0,
                 max_turns: int | None = None, invalid_penalty: float = -0.1,
                 invalid_ends: bool = False, step_latency_s: float = 0.0):
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        if not 2 <= num_words <= len(WORDS):
            raise ValueError(f"num_words must be in [2, {len(WORDS)}], got {num_words}")
        if not 0.0 <= density <= 1.0:
            raise ValueError(f"density (V_d) must be in [0, 1], got {density}")
        super().__init__(max_turns if max_turns is not None else length + 2,
                         invalid_penalty, invalid_ends, step_latency_s)
        self.length, self.num_words, self.density = int(length), int(num_words), float(density)
        self.step_reward = float(step_reward) if step_reward is not None else 1.0 / self.length
        self.outcome_reward = float(outcome_reward)
        self.num_revealed = int(round(self.density * self.length))

    def _config(self):
        return dict(super()._config(), length=self.length, num_words=self.num_words,
                    density=self.density, step_reward=self.step_reward,
                    outcome_reward=self.outcome_reward)

    def _make_task(self, rng) -> Task:
        clues = "".join(rng.choice(CLUES[:self.num_words]) for _ in range(self.length))
        revealed = frozenset(rng.sample(range(self.length), self.num_revealed))
        # the split depends on the clues only, so a clue sequence never appears in both splits
        return Task(self.family, f"{clues}|{''.join(str(int(j in revealed)) for j in range(self.length))}",
                    split_of(clues), {"clues": clues, "revealed": revealed})

    def answer(self, j: int) -> str:
        return WORDS[CLUES.index(self.task.data["clues"][j])]

    def _reset(self, task):
        self.j = 0
        self.correct: list[bool] = []

    def _parse(self, text):
        return text if text in WORDS[:self.num_words] else None

    def _apply(self, word):
        j = self.j
        ok = word == self.answer(j)
        rev = j in self.task.data["revealed"]
        self.correct.append(ok)
        self.j += 1
        reward = self.step_reward if (rev and ok) else 0.0
        info = {"step_correct": ok, "revealed": rev, "step": j}
        done = self.j == self.length
        if done:
            success = all(self.correct)
            reward += self.outcome_reward if success else 0.0
            info.update(success=success, num_correct=sum(self.correct),
                        revealed_steps=sorted(self.task.data["revealed"]))
        return reward, done, info

    def observation(self) -> str:
        if self.j >= self.length:
            return "done"
        return f"step {self.j + 1}/{self.length} clue {self.task.data['clues'][self.j]}"

    def state_key(self) -> str:
        bits = "".join("1" if c else "0" for c in self.correct)
        return f"chain:{self.task.key}|{self.j}|{bits}"

    def solver(self) -> str:
        return self.answer(min(self.j, self.length - 1))

    def random_action(self, rng) -> str:
        return rng.choice(WORDS[:self.num_words])


register("chain", Chain)
