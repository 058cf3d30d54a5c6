"""Rollout collection: run a token-in/token-out ``Sampler`` against multi-turn text envs and
emit ``pack_records``-ready trajectory records. See ``collect.py``."""

from jaxrl_agent.rollout.collect import (ByteCodec, RolloutConfig, TextCodec, collect_groups)

__all__ = ["ByteCodec", "RolloutConfig", "TextCodec", "collect_groups"]
