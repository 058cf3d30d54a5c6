"""Rollouts: the collector runs a token-in/token-out ``Sampler`` against multi-turn text envs
and emits trajectory records (``collect.py``), through the model's chat template when asked
(``chat.py``); ``records.py`` checks records and packs them into the batch contract
(``pack_records``)."""

from jaxrl_agent.rollout.chat import ChatTemplate, ChatTemplateWarning
from jaxrl_agent.rollout.collect import (ByteCodec, RolloutConfig, TextCodec, collect_groups)
from jaxrl_agent.rollout.records import (PackPlan, Record, RecordError, RecordIndex, Turn,
                                         pack, pack_records, parse_records, plan_packing)

__all__ = ["ByteCodec", "ChatTemplate", "ChatTemplateWarning", "PackPlan", "Record", "RecordError", "RecordIndex", "RolloutConfig",
           "TextCodec", "Turn", "collect_groups", "pack", "pack_records", "parse_records",
           "plan_packing"]
