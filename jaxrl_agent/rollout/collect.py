"""The rollout collector: ``G`` group-reset copies of each task, driven turn by turn by one
batched ``sampler.generate`` call per turn, recorded as token-exact trajectory records.

Token bookkeeping (the invariant the trainer relies on)::

    prompt_k = obs_0 + act_0 + obs_1 + act_1 + ... + obs_k        (token ids)

- ``obs_k`` = ``codec.encode(config.observation_template.format(observation=text))`` of the
  *new* observation text only; the history is kept as token ids and never re-tokenised.
- ``act_k`` = the sampler's ``token_ids`` exactly as sampled (stop token included when hit);
  the text given to the env is ``codec.decode`` of them with one trailing stop token removed.
- Each record turn holds ``observation`` (= ``obs_k``), ``action`` (= ``act_k``), ``logprobs``
  (the sampler's, ``len == len(action)``), ``reward`` and ``state_key`` (the env's key of the
  state *before* the action), so a ``concatenated`` row of a record is exactly
  ``prompt_K + act_K`` and a ``per_step`` row is ``obs_k + act_k``.

Record-level fields: ``group`` and ``task`` (the task id; ``"<id>#<i>"`` when a task occurs more
than once in ``tasks``), ``outcome`` = the total (summed) reward of the trajectory (the same
convention as ``Episode.to_record`` and ``pack_records``' default), ``success`` = 1.0 / 0.0 (the
env's terminal ``info["success"]``; this is what learning curves should use), ``policy_version``
(min over the turns), ``env_error`` (str or None), ``invalid`` (count of invalid actions),
``truncated`` (bool: ended by the env's or the config's ``max_turns`` or by the context limit),
``context_truncated`` (bool), ``num_turns``. ``pack_records`` ignores the extra fields.

Reported fields (``Env.reports``, e.g. the grid world's ``potential``): for every name the env
declares, each turn holds ``turn["turn_extras"][name] = float(info[name])`` of the state the
agent acted in (the info that came with the observation of that turn, as ``state_key`` and
``subgoal``), and the record holds ``traj_extras["final_" + name]`` of the state after the
last action (the last info of the episode; ``pack_records`` makes them ``extras[name]`` [N, K]
and ``extras["final_" + name]`` [N]). A trajectory that ends in an ``env_error`` keeps as final
value that of the last state that reported one (the state the failing action was taken in). A
declared field missing from an info, or not a finite float32 number, is an environment error of
that trajectory: it is dropped (counted in ``env_errors`` and ``dropped``), with a message that
names the env class, the field and the turn, since every turn of a batch must carry the same
extras. An env that declares nothing gets records without ``turn_extras`` / ``traj_extras``.

Tree rollouts (``branch_turns``, ``branch_factor``): at the start of every turn ``k`` in
``branch_turns`` each live trajectory of a task forks into ``branch_factor`` copies (itself and
``branch_factor - 1`` forks, ``Env.fork``) that share everything recorded so far and continue
independently. The turns of a fork before the branch turn are token-for-token (and key-for-key)
those of its parent, as independent copies; with ``history="full"`` its prompt at the branch
turn is its parent's. A task then yields up to ``G * branch_factor ** len(branch_turns)``
trajectories, all in one group (a trajectory that ended earlier is not forked).

Chat-template rollouts (``chat=True``): the prompt of turn 0 is the codec's chat template
rendered over ``[system?, first observation]`` with the generation prompt, and ``obs_k`` for
``k >= 1`` is what the template writes after the assistant's sampled ids: the close of the
assistant turn where not sampled, the new observation message(s) and the next generation
prompt; ``act_k`` stays the sampled ids verbatim. Each trajectory also keeps its message list
(observations as ``user`` / ``tool`` messages per ``info["observation_role"]``, actions as
``assistant`` messages with the decoded text). The record format and the invariants above are
unchanged, so ``pack_records``' action mask covers exactly the sampled assistant tokens.
The module ``jaxrl_agent.rollout.chat`` documents the bookkeeping and the policy for
templates that rewrite earlier turns.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import hashlib
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from jaxrl_agent.envs.base import Env, SafeEnv, first_errors, reset_group
from jaxrl_agent.rollout.chat import (ChatError, ChatTemplate, observation_messages,
                                      warn_if_unstable)
from jaxrl_agent.sampling.base import SamplingParams

__all__ = ["TextCodec", "ByteCodec", "RolloutConfig", "collect_groups", "HISTORY_MODES"]


@runtime_checkable
class TextCodec(Protocol):
    """What the collector needs from a tokenizer; ``jaxrl_agent.models.Tokenizer`` fits."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteCodec:
    """Byte-level codec for tests and tiny models: ``id = byte + offset``.

    Ids below ``offset`` are specials (``pad_token_id=0``, ``bos_token_id=1``,
    ``eos_token_id=2`` by default); ``vocab_size = offset + 256`` (260 by default). ``decode``
    skips ids that are not bytes and replaces invalid UTF-8.
    """

    def __init__(self, offset: int = 4, eos_token_id: int = 2, pad_token_id: int = 0,
                 bos_token_id: int = 1):
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self.offset = int(offset)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.bos_token_id = int(bos_token_id)
        if offset <= self.eos_token_id < offset + 256:
            raise ValueError("eos_token_id collides with a byte id")

    @property
    def vocab_size(self) -> int:
        return self.offset + 256

    def encode(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    #: the special tokens' text in a saved tokenizer
    SPECIALS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}
    #: what the trainer shows the policy: BOS, the observation, a newline (``observation_template``)
    CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] != 'assistant' %}"
                     "{{ m['content'] }}\n{% else %}{{ m['content'] }}{{ eos_token }}"
                     "{% endif %}{% endfor %}")

    def save_pretrained(self, folder: str) -> None:
        """Writes this codec as a Hugging Face tokenizer (``tokenizer.json``: byte-level BPE
        without merges, one token per byte at ``byte + offset``; the specials; a chat template
        that renders a user message as the training prompts do, BOS + text + newline), so
        ``transformers.AutoTokenizer``, ``models.load_tokenizer`` and ``jaxrl-agent sample``
        read a built-in model's folder. Written with the standard library only."""
        import json
        import os

        os.makedirs(folder, exist_ok=True)
        names = {self.pad_token_id: self.SPECIALS["pad_token"],
                 self.bos_token_id: self.SPECIALS["bos_token"],
                 self.eos_token_id: self.SPECIALS["eos_token"]}
        for i in range(self.offset):  # ids below offset that are not specials: reserved
            names.setdefault(i, f"<reserved_{i}>")
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": True} for i, t in sorted(names.items())]
        chars = _byte_chars()
        spec = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                              "trim_offsets": True, "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {**{t: i for i, t in names.items()},
                                **{chars[b]: b + self.offset for b in range(256)}},
                      "merges": []},
        }
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces":
                  False, "model_max_length": 1 << 30, **self.SPECIALS,
                  "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"}
                                           for a in added}}
        for name, data in (("tokenizer.json", spec), ("tokenizer_config.json", config),
                           ("special_tokens_map.json", dict(self.SPECIALS))):
            with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
                json.dump(data, f, ensure_ascii=False, indent=1)
        with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(self.CHAT_TEMPLATE)


def _byte_chars() -> list[str]:
    """The printable character that byte-level BPE tokenizers (GPT-2's mapping) use for each
    byte: printable Latin-1 bytes stand for themselves, the others for 256 + n."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
            + list(range(ord("\xae"), ord("\xff") + 1)))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


HISTORY_MODES = ("full", "last")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How to collect.

    Attributes:
      group_size: ``G`` rollouts per task (group-reset copies).
      max_turns: the most actions per trajectory (the env's own ``max_turns`` also applies);
        a trajectory stopped here is ``truncated``.
      max_new_tokens: the most tokens per action.
      max_context_tokens: a turn runs only if ``len(prompt) + max_new_tokens <=
        max_context_tokens``; otherwise the trajectory ends *before* that turn (the new
        observation is not recorded) and is flagged ``truncated``/``context_truncated``. A
        trajectory that cannot even take its first turn is dropped (counted in
        ``stats["dropped"]``). Set it to at most the sampler's ``max_len``.
      temperature, top_k, top_p: sampling parameters (``SamplingParams`` semantics).
      stop_token_ids: ``None`` = ``(codec.eos_token_id,)``.
      on_invalid: ``"penalise"`` (the env's invalid penalty, the episode goes on) or ``"fail"``
        (an invalid action ends the trajectory, ``success = 0``).
      observation_template: how a new observation text becomes prompt text.
      history: ``"full"`` (the prompt of turn k is the whole token history, above) or
        ``"last"`` (the prompt is only ``prompt_prefix + obs_k``: for fully observed, Markov
        environments such as the grid world; such records must be packed ``per_step``, whose
        rows are then exactly what the sampler saw).
      prompt_prefix: token ids put before the first observation (``"full"``) or before every
        observation (``"last"``), e.g. a BOS token; recorded as part of the observation.
      branch_turns: the turns (0-based, each ``< max_turns``) at whose start every live
        trajectory forks (tree rollouts); stored sorted. ``()`` = no branching.
      branch_factor: ``K``, the copies a trajectory becomes at a branch turn (itself and
        ``K - 1`` forks). ``group_size`` stays the number of independent roots per task, so a
        task yields up to ``group_size * K ** len(branch_turns)`` trajectories. ``K = 1`` or no
        ``branch_turns`` collects exactly as without them.
      chat: talk to the policy through the codec's chat template (module docstring; the codec
        must have one, e.g. an HF instruct tokenizer, else ``collect_groups`` raises a
        ValueError naming ``rollout.chat``). Observations become ``user`` messages, or ``tool``
        messages when the env sets ``info["observation_role"] = "tool"`` (several messages at
        once: ``info["observation_messages"]``); the env's ``tools`` (JSON schemas, OpenAI
        function format), when it has any, are passed to the template as ``tools=``.
        ``observation_template`` and ``prompt_prefix`` are not used: the template writes the
        whole prompt (BOS included where the family has one). With ``stop_token_ids = None``
        sampling also stops on the template's end-of-turn token (``<|im_end|>``,
        ``<|eot_id|>``) when it is not the codec's EOS. ``history="last"`` works too: every
        prompt is then the render of ``[system?, newest observation message(s)]``.
      system_prompt: the system message put first in every chat conversation; None = the
        env's ``system_prompt`` attribute when it has one, else no system message. Only used
        with ``chat``.
      env_threads: envs stepped at once within a turn (a thread pool); 1 steps them one after
        another. For environments that wait rather than compute (tool calls, HTTP envs, the
        built-in envs' ``step_latency_s``), N threads hide up to N waits behind one.
    """

    group_size: int = 8
    max_turns: int = 16
    max_new_tokens: int = 32
    max_context_tokens: int = 4096
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    on_invalid: str = "penalise"
    observation_template: str = "{observation}\n"
    history: str = "full"
    prompt_prefix: tuple[int, ...] = ()
    branch_turns: tuple[int, ...] = ()
    branch_factor: int = 1
    chat: bool = False
    system_prompt: str | None = None
    env_threads: int = 1

    def __post_init__(self):
        for name in ("group_size", "max_turns", "max_new_tokens", "max_context_tokens",
                     "env_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RolloutConfig.{name} must be an int >= 1, got {v!r}")
        if self.on_invalid not in ("penalise", "fail"):
            raise ValueError(f"RolloutConfig.on_invalid must be 'penalise' or 'fail', got "
                             f"{self.on_invalid!r}")
        if self.history not in HISTORY_MODES:
            raise ValueError(f"RolloutConfig.history must be one of {HISTORY_MODES}, got "
                             f"{self.history!r}")
        object.__setattr__(self, "prompt_prefix", tuple(int(i) for i in self.prompt_prefix))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in self.stop_token_ids))
        object.__setattr__(self, "branch_turns", _check_branch_turns(self.branch_turns,
                                                                     self.max_turns))
        k = self.branch_factor
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"RolloutConfig.branch_factor must be an int >= 1, got {k!r}")
        if not isinstance(self.chat, bool):
            raise ValueError(f"RolloutConfig.chat must be a bool, got {self.chat!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"RolloutConfig.system_prompt must be a str or None, got "
                             f"{self.system_prompt!r}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_branch_turns(turns, max_turns: int) -> tuple[int, ...]:
    """``turns`` as a sorted tuple, or ValueError unless they are distinct ints in
    ``[0, max_turns)``."""
    try:
        turns = tuple(turns)
    except TypeError:
        raise ValueError(f"RolloutConfig.branch_turns must be a sequence of ints, got "
                         f"{turns!r}") from None
    if not all(_is_int(t) and 0 <= t < max_turns for t in turns) or \
            len(set(turns)) != len(turns):
        raise ValueError(f"RolloutConfig.branch_turns must be distinct ints in [0, max_turns = "
                         f"{max_turns}), got {turns!r}")
    return tuple(sorted(turns))


def _request_seed(seed: int, traj: int, turn: int) -> int:
    h = hashlib.blake2b(f"{seed}:{traj}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little")


def _base_env(env_factory_or_env):
    if not isinstance(env_factory_or_env, type) and hasattr(env_factory_or_env, "reset") \
            and hasattr(env_factory_or_env, "clone"):
        return env_factory_or_env
    if callable(env_factory_or_env):
        return env_factory_or_env()
    raise TypeError("env_factory_or_env must be an env (reset/step/clone) or a zero-argument "
                    f"factory, got {type(env_factory_or_env).__name__}")


@dataclasses.dataclass
class _Live:
    index: int  # the trajectory index of the request seeds
    env: Any
    group: str
    task: str
    history: list
    pending_obs: list  # tokens of the observation not yet followed by an action
    state_key: Any
    subgoal: Any = None  # the env's info["subgoal"] of the state before the next action
    turns: list = dataclasses.field(default_factory=list)
    done: bool = False
    success: bool = False
    env_error: str | None = None
    invalid: int = 0
    truncated: bool = False
    context_truncated: bool = False
    dropped: bool = False
    order: tuple = ()  # (task position, root, copy at each branch so far): the record order
    fork_failed: bool = False
    chat: Any = None  # the ChatTemplate of this trajectory (chat rollouts)
    messages: list = dataclasses.field(default_factory=list)  # its conversation, no system
    report_names: tuple = ()  # the fields its env declares (Env.reports)
    teacher_context: str | None = None  # the reset info's privileged text (teacher only)
    # their values at the state before the next action (after the last one: the final state)
    reports: dict = dataclasses.field(default_factory=dict)


def collect_groups(env_factory_or_env, tasks: Sequence, sampler, codec: TextCodec,
                   config: RolloutConfig, *, seed: int | None = 0,
                   ) -> tuple[list[dict], dict]:
    """Collects ``config.group_size`` trajectories of every task.

    Args:
      env_factory_or_env: an env (each task gets ``env.clone()`` copies; the env itself is
        never stepped) or a zero-argument factory. Envs are wrapped in ``SafeEnv`` unless they
        already are one, so env faults end a trajectory (``env_error``), never the run.
      tasks: ``Task`` objects of the env's family.
      sampler: a ``Sampler``; ``generate`` is called once per turn with the prompts of every
        live trajectory (of all groups), in a stable order.
      codec: a ``TextCodec`` (``Tokenizer`` or ``ByteCodec``).
      seed: ``None`` lets the sampler draw from its own stream; an int gives every request a
        seed derived from ``(seed, trajectory index, turn)``, so a run is reproducible whatever
        the batching. Roots are indexed ``0 .. len(tasks) * G - 1`` in task order; every fork
        gets the next free index when it is created (tasks in order, then the tree order below).

    Returns:
      ``(records, stats)``; records are in task order, the trajectories of one task
      consecutive and pack with ``pack_records`` in both layouts. Within a task they are in
      depth-first tree order: root by root, and at every branch turn the parent's subtree, then
      its first fork's subtree, and so on (without branching: the ``G`` roots in order).
      The prompts of each ``generate`` call are in the same order. ``stats``: ``trajectories``,
      ``successes``, ``success_rate``, ``mean_reward`` (mean outcome), ``env_errors``,
      ``invalid_actions``, ``truncated``, ``context_truncated``, ``dropped``, ``turns``,
      ``forks`` (fork trajectories created, failed ones included), ``fork_errors``, ``generate_calls``,
      ``tokens_generated``, ``wall_time_s``, ``tokens_per_s``. ``turns`` and
      ``invalid_actions`` count per trajectory (a turn shared by a tree's copies once for each);
      ``tokens_generated`` counts the tokens actually sampled. With ``config.chat`` also
      ``chat_template_prefix_stable`` (1 when every chat template used passed the
      prefix-stability probe of ``jaxrl_agent.rollout.chat``, else 0) and
      ``chat_rerender_differs`` (recorded trajectories, ``history="full"``, whose last prompt
      differs from the template's render of their conversation up to it).

    A fork whose ``Env.fork`` fails (``SafeEnv.fork``) is dropped (counted in ``dropped``,
    ``env_errors`` and ``fork_errors``): its shared turns are its parent's, and recording them
    with a made-up ending would bias the group's baseline. Its siblings go on. So is a
    trajectory whose env leaves out a field it declares in ``reports`` (module docstring;
    counted in ``dropped`` and ``env_errors``). ValueError naming the env when its ``reports``
    is not a ``{field name: description}`` mapping.
    """
    t0 = time.perf_counter()
    chats = _ChatTemplates(codec, config) if config.chat else None
    stop_ids = config.stop_token_ids
    if stop_ids is None:
        stop_ids = tuple(dict.fromkeys(int(i) for i in (
            codec.eos_token_id, chats.base.end_of_turn_id if chats else None) if i is not None))
        if not stop_ids:
            raise ValueError("codec has no eos_token_id: give RolloutConfig.stop_token_ids")
    stop_set = set(stop_ids)
    base = _base_env(env_factory_or_env)
    live = _start(base, list(tasks), codec, config, chats, _report_names(base))
    calls = tokens_generated = forks = 0
    pool = (concurrent.futures.ThreadPoolExecutor(config.env_threads, "env")
            if config.env_threads > 1 else None)
    try:
        for turn in range(config.max_turns):
            running = [tr for tr in live if not tr.done]
            _stop_at_context_limit(running, config)
            if turn in config.branch_turns and config.branch_factor > 1:
                new = _branch([tr for tr in running if not tr.done], config.branch_factor,
                              len(live))
                forks += len(new)
                live = sorted(live + new, key=lambda tr: tr.order)
            ready = [tr for tr in live if not tr.done]
            if not ready:
                break
            prompts = [tr.history + tr.pending_obs for tr in ready]
            params = [SamplingParams(temperature=config.temperature, top_k=config.top_k,
                                     top_p=config.top_p, max_new_tokens=config.max_new_tokens,
                                     stop_token_ids=stop_ids,
                                     seed=None if seed is None
                                     else _request_seed(seed, tr.index, turn))
                      for tr in ready]
            outputs = sampler.generate(prompts, params)
            calls += 1
            if len(outputs) != len(ready):
                raise RuntimeError(f"sampler returned {len(outputs)} outputs for {len(ready)} "
                                   f"prompts")
            texts = [_action_text(tr, out, codec, stop_set) for tr, out in zip(ready, outputs)]
            steps = list((pool.map if pool else map)(
                lambda tr_text: tr_text[0].env.step(tr_text[1]), zip(ready, texts)))
            for tr, prompt, out, text, res in zip(ready, prompts, outputs, texts, steps):
                tokens_generated += _act(tr, prompt, out, text, res, codec, config)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    for tr in live:  # still running after config.max_turns
        if not tr.done:
            tr.done = tr.truncated = True
    records = [_record(tr) for tr in live if not tr.dropped]
    stats = _stats(records, live, forks=forks, calls=calls, tokens_generated=tokens_generated,
                   wall=time.perf_counter() - t0)
    if chats is not None:
        stats["chat_template_prefix_stable"] = int(chats.prefix_stable())
        stats["chat_rerender_differs"] = sum(
            _rerender_differs(tr) for tr in live if not tr.dropped and config.history == "full")
    return records, stats


class _EnvAttributeError(RuntimeError):
    """Reading an env's chat attributes (``tools``, ``system_prompt``) raised."""


class _ChatTemplates:
    """The chat templates of one collection: one ``ChatTemplate`` per (system prompt, tools)
    that the trajectories use, made when first needed; ``base`` (the config's system prompt,
    no tools) is made at the start, so a codec without a chat template fails there."""

    def __init__(self, codec, config: RolloutConfig):
        self.codec, self.config = codec, config
        self.base = ChatTemplate(codec, system_prompt=config.system_prompt)
        self.made: dict = {}

    def for_env(self, env) -> ChatTemplate:
        """The template of a trajectory on ``env`` (its ``tools`` and ``system_prompt``,
        the config's system prompt first)."""
        system = self.config.system_prompt
        try:  # an env's attribute may be a property that talks to a server
            if system is None:
                system = getattr(env, "system_prompt", None)
            tools = getattr(env, "tools", None) or None
        except Exception as e:  # noqa: BLE001 - an env fault ends the trajectory
            raise _EnvAttributeError(f"reading the env's system_prompt / tools failed: "
                                     f"{type(e).__name__}: {e}") from e
        if tools is not None and not isinstance(tools, (str, bytes, dict)):
            try:
                tools = list(tools)
            except TypeError:
                pass
        key = (system if isinstance(system, str) else repr(system), repr(tools))
        if key not in self.made:
            template = ChatTemplate(self.codec, system_prompt=system, tools=tools)
            if tools and "tool" in template.silent_roles:
                raise ChatError(
                    "rollout.chat: the chat template renders 'tool' messages as nothing (their "
                    "content is not in the prompt), so the agent would never see its tools' "
                    "results. Use a chat template with a branch for the tool role (e.g. the "
                    "model family's own), or have the environment send tool results as user "
                    "messages (info['observation_role'] = 'user')")
            warn_if_unstable(template, stacklevel=4)  # the caller of collect_groups
            self.made[key] = template
        return self.made[key]

    def prefix_stable(self) -> bool:
        return all(t.prefix_stable for t in (self.made.values() or [self.base]))


def _rerender_differs(tr: _Live) -> bool:
    """Whether the last prompt of a chat trajectory differs from the template's render of its
    conversation up to that prompt."""
    if tr.chat is None or len(tr.turns) < 2:
        return False
    last = max(i for i, m in enumerate(tr.messages) if m["role"] == "assistant")
    held = [t for turn in tr.turns[:-1] for t in turn["observation"] + turn["action"]]
    try:
        return held + tr.turns[-1]["observation"] != tr.chat.prompt(tr.messages[:last])
    except ValueError:  # the template cannot render the whole conversation at once
        return True


def _refuse_unused_system(env, label: str) -> None:
    """Raw-text prompts (``rollout.chat: false``) have no place for a system message: one that
    the task (or the environment) gives after ``reset`` would be dropped without a word, so it
    is refused, naming the task and the two ways out."""
    try:
        system = getattr(env, "system_prompt", None)
    except Exception:  # noqa: BLE001 - a property that fails: the chat path reports it
        return
    if system:
        raise ChatError(
            f"task {label}: the environment gives a system message ({system!r:.60}), which raw-"
            f"text prompts (rollout.chat: false) leave out. Set rollout.chat: true to render it "
            f"with the checkpoint's chat template, or remove it (the task's \"system\" field or "
            f"system message, or the environment's system_prompt)")


def _start(base: Env, tasks: list, codec: TextCodec, config: RolloutConfig,
           chats: _ChatTemplates | None = None, report_names: tuple = ()) -> list:
    """``G`` group-reset copies of every task, observed; a copy whose reset failed (or whose
    first info lacks a reported field) is marked dropped (nothing to record)."""
    ids = [t.id for t in tasks]
    live: list[_Live] = []
    for ti, task in enumerate(tasks):
        root = base.clone()
        root = root if isinstance(root, SafeEnv) else SafeEnv(root)
        label = task.id if ids.count(task.id) == 1 else f"{task.id}#{ti}"
        for g, (env, obs, info) in enumerate(reset_group(root, task, config.group_size)):
            tr = _Live(len(live), env, label, label, [], [], None, order=(ti, g),
                       report_names=report_names)
            if chats is not None and not (info.get("done") or info.get("env_error")):
                try:
                    tr.chat = chats.for_env(env)
                except _EnvAttributeError as e:  # like a failed reset
                    info = {"env_error": str(e)}
            elif chats is None and g == 0 and not info.get("env_error"):
                _refuse_unused_system(env, label)
            if info.get("done") or info.get("env_error"):  # reset failed: nothing to record
                tr.done, tr.dropped, tr.env_error = True, True, str(info.get("env_error"))
            else:
                _observe(tr, obs, info, codec, config)
                _take_reports(tr, info)
                context = info.get("teacher_context")
                tr.teacher_context = None if context is None else str(context)
            live.append(tr)
    return live


def _stop_at_context_limit(running: list, config: RolloutConfig) -> None:
    """Ends (truncated) every trajectory whose next turn would not fit the context; one that
    has no turn yet is dropped."""
    for tr in running:
        if len(tr.history) + len(tr.pending_obs) + config.max_new_tokens > \
                config.max_context_tokens:
            tr.done = tr.truncated = tr.context_truncated = True
            tr.dropped = not tr.turns


def _action_text(tr: _Live, out, codec: TextCodec, stop_set: set) -> str:
    """The text the env gets for a sampled action: its ids decoded, one trailing stop token
    removed. Raises RuntimeError for a malformed sampler output."""
    n_tok, n_lp = len(out.token_ids), len(out.logprobs)
    if not n_tok or n_lp != n_tok:
        raise RuntimeError(f"sampler output for trajectory {tr.index}: {n_tok} tokens "
                           f"and {n_lp} logprobs (need equal and >= 1)")
    act = [int(t) for t in out.token_ids]
    return codec.decode(act[:-1] if act[-1] in stop_set else act)


def _act(tr: _Live, prompt: list, out, text: str, res, codec: TextCodec,
         config: RolloutConfig) -> int:
    """Records one sampled action of ``tr`` (``text``: ``_action_text``; ``res``: its env's
    ``step(text)``) and observes the result (or ends the trajectory). Returns the number of
    tokens sampled."""
    act = [int(t) for t in out.token_ids]
    lps = [float(x) for x in out.logprobs]
    if tr.chat is not None:
        tr.messages.append({"role": "assistant", "content": text})
    info = res.info or {}
    invalid = bool(info.get("invalid_action", False))
    tr.invalid += invalid
    turn = {"observation": tr.pending_obs, "action": act, "logprobs": lps,
            "reward": float(res.reward), "state_key": tr.state_key,
            "action_text": text, "finish_reason": out.finish_reason,
            "policy_version": int(out.policy_version)}
    if tr.subgoal is not None:  # recorded as the env reported it (train.inputs reads it)
        turn["subgoal"] = tr.subgoal
    if tr.report_names:  # the env's reported fields of the state acted in
        turn["turn_extras"] = dict(tr.reports)
    tr.turns.append(turn)
    tr.history = prompt + act if config.history == "full" else []
    if info.get("env_error"):
        tr.env_error = str(info["env_error"])
    else:
        _take_reports(tr, info)  # the new state's (a missing field drops tr: env_error)
    done = bool(res.done) or tr.env_error is not None
    if invalid and config.on_invalid == "fail":
        done = True
    if done:
        tr.done = True
        tr.success = bool(info.get("success", False)) and not (
            invalid and config.on_invalid == "fail")
        tr.truncated = tr.truncated or bool(info.get("truncated", False))
    else:
        _observe(tr, res.observation, info, codec, config)
    return len(act)


def _record(tr: _Live) -> dict:
    """The trajectory record of a finished trajectory (format: module docstring)."""
    rec = {
        "group": tr.group, "task": tr.task, "outcome": float(sum(t["reward"] for t in tr.turns)),
        "success": 1.0 if tr.success else 0.0, "turns": tr.turns,
        "policy_version": min(t["policy_version"] for t in tr.turns),
        "env_error": tr.env_error, "invalid": tr.invalid, "truncated": tr.truncated,
        "context_truncated": tr.context_truncated, "num_turns": len(tr.turns)}
    if tr.report_names:  # the reported fields of the final state
        rec["traj_extras"] = {FINAL_PREFIX + name: x for name, x in tr.reports.items()}
    if tr.teacher_context is not None:  # privileged text for a teacher (Env.teacher_context)
        rec["teacher_context"] = tr.teacher_context
    return rec


#: ``traj_extras`` name of a reported field's final value: ``final_<name>``
FINAL_PREFIX = "final_"
_F32_MAX = 3.4028234663852886e38  # the largest float32: batches are packed in float32


class ReportError(ValueError):
    """An env left out (or gave a non-number for) a field it declares in ``reports``."""


def _env_name(env) -> str:
    """The class name of ``env``, looking through its ``SafeEnv``."""
    return type(env.env if isinstance(env, SafeEnv) else env).__name__


def _report_names(env) -> tuple:
    """The fields ``env`` declares in ``reports`` (``Env.reports``), in order; ``()`` when it
    has none. ValueError naming the env when ``reports`` is not a mapping of distinct
    non-empty str names none of which is another's ``final_<name>``."""
    reports = getattr(env, "reports", None) or {}
    names = tuple(reports) if isinstance(reports, Mapping) else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{_env_name(env)}.reports must be a dict {{field name: description}}, "
                         f"got {reports!r:.200}")
    clash = [n for n in names if FINAL_PREFIX + n in names]
    if clash:
        raise ValueError(f"{_env_name(env)}.reports declares both {clash[0]!r} and "
                         f"{FINAL_PREFIX + clash[0]!r}; the collector records the final value "
                         f"of {clash[0]!r} under the second name: rename one")
    return names


def _report_problem(info: dict, name: str) -> str | None:
    """Why ``info[name]`` is not a reported value (a finite real number within float32), or
    None when it is."""
    if name not in info:
        return f"has no {name!r}"
    x = info[name]
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        return f"has {name}={x!r:.60} (a {type(x).__name__}, not a number)"
    try:
        ok = math.isfinite(float(x)) and abs(float(x)) <= _F32_MAX
    except OverflowError:  # an int beyond any float
        ok = False
    return None if ok else f"has {name}={x!r:.60} (not a finite float32 number)"


def _take_reports(tr: _Live, info: dict) -> None:
    """Sets ``tr.reports`` to the declared fields of ``info`` (the info of the state after
    ``len(tr.turns)`` actions). When one is missing or not a number, ``tr`` ends as an
    environment error and is dropped: its turns could not all carry the field. The first such
    error is also noted in ``envs.first_errors``, where the trainer shows it once."""
    values = {}
    for name in tr.report_names:
        problem = _report_problem(info, name)
        if problem is not None:
            message = (f"{_env_name(tr.env)} declares reports[{name!r}] but info at turn "
                       f"{len(tr.turns)} {problem}")
            try:
                raise ReportError(message)
            except ReportError as e:  # noted with its traceback, like SafeEnv's errors
                first_errors.note(e)
            tr.done, tr.dropped, tr.env_error = True, True, f"ReportError: {message}"
            return
        values[name] = float(info[name])
    tr.reports = values


def _stats(records: list, live: list, *, forks: int, calls: int, tokens_generated: int,
           wall: float) -> dict:
    """The collection's counters (``collect_groups``' Returns)."""
    n = len(records)
    successes = int(sum(r["success"] for r in records))
    return {
        "trajectories": n, "successes": successes, "success_rate": successes / n if n else 0.0,
        "mean_reward": sum(r["outcome"] for r in records) / n if n else 0.0,
        "env_errors": sum(tr.env_error is not None for tr in live),
        "invalid_actions": sum(tr.invalid for tr in live),
        "truncated": sum(r["truncated"] for r in records),
        "context_truncated": sum(tr.context_truncated for tr in live),
        "dropped": sum(tr.dropped for tr in live),
        "turns": sum(len(tr.turns) for tr in live if not tr.fork_failed), "forks": forks,
        "fork_errors": sum(tr.fork_failed for tr in live), "generate_calls": calls,
        "tokens_generated": tokens_generated, "wall_time_s": wall,
        "tokens_per_s": tokens_generated / wall if wall > 0 else 0.0,
    }


def _branch(parents: list[_Live], factor: int, next_index: int) -> list[_Live]:
    """The ``factor - 1`` forks of every parent (in order), indexed from ``next_index``; every
    parent's ``order`` is extended by copy 0, its forks' by copies ``1 .. factor - 1``."""
    forks = []
    for tr in parents:
        base = tr.order
        tr.order = base + (0,)
        for j in range(1, factor):
            forks.append(_fork(tr, next_index + len(forks), base + (j,)))
    return forks


def _fork(tr: _Live, index: int, order: tuple) -> _Live:
    """A copy of live trajectory ``tr`` sharing no mutable state with it, on a fork of its env.
    A failed env fork (``SafeEnv.fork``'s ``fork_error``) ends the copy with ``env_error``."""
    env = tr.env.fork()
    out = dataclasses.replace(tr, index=index, env=env, order=order, history=list(tr.history),
                              pending_obs=list(tr.pending_obs), turns=copy.deepcopy(tr.turns),
                              subgoal=copy.deepcopy(tr.subgoal), reports=dict(tr.reports),
                              messages=copy.deepcopy(tr.messages))
    error = getattr(env, "fork_error", None)
    if error is not None:  # not a trajectory of the policy: never trained on or counted
        out.done, out.env_error, out.dropped, out.fork_failed = True, str(error), True, True
    return out


def _observe(tr: _Live, obs_text: str, info: dict, codec: TextCodec, config: RolloutConfig):
    if tr.chat is not None:
        _observe_chat(tr, obs_text, info, config)
    else:
        prefix = list(config.prompt_prefix) if (config.history == "last" or not tr.turns) else []
        tr.pending_obs = prefix + [int(i) for i in codec.encode(
            config.observation_template.format(observation=obs_text))]
    key = info.get("state_key")
    tr.state_key = key if isinstance(key, (str, int)) and not isinstance(key, bool) else obs_text
    tr.subgoal = info.get("subgoal")


def _context_messages(tr: _Live) -> list:
    """The env's ``context_messages`` for this task (the conversation before its first
    observation, e.g. a task file's few-shot turns), or []; a ValueError naming the env when
    they are not chat messages."""
    ctx = getattr(tr.env, "context_messages", None) or []
    ok = isinstance(ctx, (list, tuple)) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(
            m.get("content"), str) for m in ctx)
    if not ok:
        env = getattr(tr.env, "env", tr.env)
        raise ValueError(f"rollout.chat: env {type(env).__name__}, task {tr.task}: "
                         f"context_messages must be a list of {{role, content}} messages, got "
                         f"{ctx!r:.200}")
    return [dict(m) for m in ctx]


def _observe_chat(tr: _Live, obs_text: str, info: dict, config: RolloutConfig):
    """The new observation's tokens of a chat trajectory (module docstring)."""
    try:
        new = observation_messages(obs_text, info)
        silent = sorted({m["role"] for m in new if m["role"] in tr.chat.silent_roles})
        if silent:  # the template would render the observation as nothing: the agent is blind
            raise ChatError(
                f"the chat template renders {silent[0]!r} messages as nothing, so this "
                f"observation would never reach the agent; send it as a user message "
                f"(info['observation_role'] = 'user') or use a chat template with a branch "
                f"for the {silent[0]!r} role")
    except ValueError as e:
        env = getattr(tr.env, "env", tr.env)  # the env inside its SafeEnv
        raise ValueError(f"rollout.chat: env {type(env).__name__}, task {tr.task}: {e}") from None
    if config.history == "last":
        tr.messages = new
        tr.pending_obs = tr.chat.prompt(new)
    elif not tr.turns:  # the task's own earlier turns (few-shot history) come first
        tr.messages = _context_messages(tr) + list(new)
        tr.pending_obs = tr.chat.prompt(tr.messages)
    else:
        tr.messages.extend(new)
        tr.pending_obs = tr.chat.continuation(new, after=tr.turns[-1]["action"])
