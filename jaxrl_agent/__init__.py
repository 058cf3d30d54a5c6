"""jaxrl-agent: credit assignment and RL training for multi-turn LLM agents, in JAX."""

from jaxrl_agent.batch import Advantages, TrajectoryBatch, pack_records

__version__ = "0.1.0"
__all__ = ["Advantages", "TrajectoryBatch", "pack_records", "__version__"]
