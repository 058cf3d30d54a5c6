"""jaxrl-agent: credit assignment and RL training for multi-turn LLM agents, in JAX."""

from jaxrl_agent.batch import Advantages, TrajectoryBatch
from jaxrl_agent.rollout.records import pack_records
from jaxrl_agent.registry import register

__version__ = "0.1.0"
__all__ = ["Advantages", "TrajectoryBatch", "pack_records", "register", "__version__"]
