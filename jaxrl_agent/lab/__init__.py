"""The credit lab: does a credit-assignment method assign the right credit?

Small tabular MDPs (``tasks``) with exact advantages (``mdp``), rollouts packed as the
library's ``TrajectoryBatch`` (``sampling``), any registered estimator or composition run on
them (``arms``), scored against the exact answer (``scoring``) and trained with the PPO loss
(``learning``); ``report`` runs a comparison and writes its table, JSON and plots;
``experiments`` holds the reproductions of ``docs/lab.md``. On the command line:
``jaxrl-agent lab``.

    from jaxrl_agent.lab import arms, learning, scoring, tasks
    tree = tasks.make_task("tree")
    scoring.score_arm(tree, arms.parse_arm("gigpo"), seeds=8)       # credit vs exact A
    chain = tasks.make_task("chain", exposed=2)
    learning.train_curves(chain.mdp, arms.parse_arm("uniform"))     # exact success per step
"""

from jaxrl_agent.lab.arms import NAMED_ARMS, Arm, parse_arm, parse_arms
from jaxrl_agent.lab.mdp import (TabularMDP, exact_advantages, exact_values, expected_return,
                                 make_mdp, optimal_return)
from jaxrl_agent.lab.tasks import TASKS, Task, make_task

__all__ = ["Arm", "NAMED_ARMS", "TASKS", "TabularMDP", "Task", "exact_advantages",
           "exact_values", "expected_return", "make_mdp", "make_task", "optimal_return",
           "parse_arm", "parse_arms"]
