"""Chat-template rollouts: a conversation's token ids kept exactly as the sampler saw them.

With ``RolloutConfig.chat`` the collector talks to an instruct model through its tokenizer's
chat template instead of ``observation_template``. Every trajectory keeps a message list
(the system prompt if any, the observations as ``user`` / ``tool`` messages, the decoded
actions as ``assistant`` messages) and a held token list, which only ever grows::

    held = prompt_0 + act_0 + new_1 + act_1 + ... + new_k     (the prompt of turn k)

- ``prompt_0`` = the template's render of ``[system?, first observation]`` with the
  generation prompt (``ChatTemplate.prompt``).
- ``act_k`` = the sampler's ids exactly as sampled, the end-of-turn token included when it was
  sampled. Never re-tokenised: the decoded text only goes to the env and the message list.
- ``new_k`` = the template's tokens that close the assistant turn and were not sampled (Qwen's
  ``"\\n"`` after ``<|im_end|>``; the whole close when the action was cut by ``max_new_tokens``),
  then the new observation message(s), then the next generation prompt
  (``ChatTemplate.continuation``).

``new_k`` is computed by rendering, never by re-tokenising decoded history, and from a fixed
stand-in conversation rather than the real one: the template renders ``[system?, user
"Hello.", assistant <marker>, *new messages]`` with the generation prompt, and ``new_k`` is the
encoded text after ``<marker>``. The split sits right before the template's end-of-turn token
(a special token, so encoding the tail alone gives the same ids as encoding the whole), and a
template that rewrites earlier turns (Qwen3 drops the ``<think>`` block of assistant turns
before the last user message) cannot corrupt the delta, because the earlier turns are not the
real ones. When an action ends with the template's end-of-turn token, that token is not added
again.

Prefix stability. A template is *prefix-stable* when the render of the whole conversation
equals the held ids. ``ChatTemplate`` checks this once per codec, system prompt and tools, on
probe conversations (``ChatTemplate.probe``: plain user turns, tool results including two back
to back, and ``<think>`` reasoning followed by a new user turn), by running this bookkeeping
and comparing every prompt with the template's render of the conversation so far.

Policy for templates that are not prefix-stable (for example Qwen3 with reasoning): training
uses the ids as held. The sampled ids are never rewritten and every prompt the sampler saw is
exactly a prefix of the held ids, so the action mask covers exactly the sampled assistant
tokens and the log-probs belong to the tokens they were sampled for. What differs is only the
template's own re-render of the whole conversation (it would, for example, drop earlier
``<think>`` blocks): a model served later with that template sees a different history than the
one trained on. The collector says so once per template (``ChatTemplateWarning``) and reports
``chat_template_prefix_stable`` (0) and ``chat_rerender_differs`` (trajectories whose last
prompt differs from the template's render of their conversation) in its statistics.
Templates that trim message text (Llama 3) re-render an action with leading or trailing
whitespace differently too; the per-trajectory count shows how often that happened.
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = ["ChatTemplate", "ChatTemplateWarning", "observation_messages", "warn_if_unstable",
           "OBSERVATION_ROLES"]

#: roles an observation message may have (``info["observation_role"]``)
OBSERVATION_ROLES = ("user", "tool")

#: stand-ins for the assistant's content in the stand-in conversation: plain ASCII without
#: whitespace or markup, so no template trims, splits or escapes them
_MARKERS = ("Qz7marker0Kx", "Vw3marker5Jq", "Hy9marker2Rf")
_STAND_IN_USER = "Hello."

#: the probe conversations: (name, [(observation messages, assistant text), ...]); the
#: assistant texts start and end with a non-space character, so encoding them alone gives the
#: ids a tokenizer gives them inside the render
_PROBES = (
    ("plain", [
        ([{"role": "user", "content": "What is 2 + 2?"}], "It is 4."),
        ([{"role": "user", "content": "And 3 + 3?"}], "It is 6."),
        ([{"role": "user", "content": "Thanks!"}], "You are welcome."),
    ]),
    ("tool", [
        ([{"role": "user", "content": "Add 2 and 3, then 4 and 5."}],
         '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
        ([{"role": "tool", "content": "5"}],
         '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>'),
        ([{"role": "tool", "content": "9"}, {"role": "tool", "content": "done"}],
         "The sums are 5 and 9."),
        ([{"role": "user", "content": "Good."}], "Glad to help."),
    ]),
    ("reasoning", [
        ([{"role": "user", "content": "What is 2 + 2?"}],
         "<think>\nTwo plus two is four.\n</think>\n\nIt is 4."),
        ([{"role": "user", "content": "And 3 + 3?"}],
         "<think>\nThree plus three is six.\n</think>\n\nIt is 6."),
        ([{"role": "user", "content": "Thanks!"}], "You are welcome."),
    ]),
)

#: probe results per codec: {(template, system prompt, tools as JSON): _Probe}
_PROBE_CACHE: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()
#: templates already warned about (one warning per template text and process)
_WARNED: set = set()


class ChatTemplateWarning(UserWarning):
    """The chat template is not prefix-stable: its render of a whole conversation differs
    from the ids the collector holds (and trains on)."""


class ChatError(ValueError):
    """Chat rollouts cannot work with this template, codec or environment (the message names
    ``rollout.chat`` and what to change)."""


def _chat_error(message: str) -> ValueError:
    return ChatError(f"rollout.chat: {message}")


def observation_messages(text: str, info: dict | None) -> list[dict]:
    """The message(s) that carry a new observation.

    ``info["observation_messages"]``, when given, is used as is: a non-empty list of
    ``{"role": "user" | "tool", "content": str, ...}`` dicts (several tool results of one
    action, say). Otherwise one message ``{"role": info.get("observation_role", "user"),
    "content": text}``; a ``"tool"`` message also gets ``"name": info["tool_name"]`` when the
    env names the tool.

    Raises:
      ValueError: a role other than ``"user"`` / ``"tool"``, content that is not text, or a
        malformed ``observation_messages`` (the message names the key).
    """
    info = info or {}
    given = info.get("observation_messages")
    if given is not None:
        if not isinstance(given, (list, tuple)) or not given:
            raise ValueError(f"info['observation_messages'] must be a non-empty list of "
                             f"messages, got {given!r}")
        out = []
        for i, m in enumerate(given):
            if not isinstance(m, dict):
                raise ValueError(f"info['observation_messages'][{i}] must be a dict with "
                                 f"'role' and 'content', got {m!r}")
            _check_message(m.get("role"), m.get("content"),
                           f"info['observation_messages'][{i}]")
            out.append(dict(m))
        return out
    role = info.get("observation_role", "user")
    _check_message(role, text, "info['observation_role']")
    msg = {"role": role, "content": text}
    name = info.get("tool_name")
    if role == "tool" and isinstance(name, str) and name:
        msg["name"] = name
    return [msg]


def _check_message(role, content, where: str) -> None:
    if role not in OBSERVATION_ROLES:
        raise ValueError(f"{where}: an observation's role must be one of {OBSERVATION_ROLES}, "
                         f"got {role!r}")
    if not isinstance(content, str):
        raise ValueError(f"{where}: an observation's content must be a str, got "
                         f"{type(content).__name__}")


class _Probe:
    """What ``ChatTemplate`` learns about a template once (see ``ChatTemplate``)."""

    def __init__(self, end_of_turn_id, results):
        self.end_of_turn_id = end_of_turn_id
        self.results = results


class ChatTemplate:
    """A codec's chat template, bound to a system prompt and tool schemas, as the collector
    uses it (the module docstring has the bookkeeping and the policy).

    Args:
      codec: a tokenizer with a chat template: ``chat_template`` (the Jinja text),
        ``render_chat(messages, add_generation_prompt, **kw) -> str``,
        ``apply_chat_template(messages, add_generation_prompt, **kw) -> ids``, ``encode``
        (no special tokens added) and ``decode(ids, skip_special_tokens=...)``, as
        ``jaxrl_agent.models.Tokenizer`` has.
      system_prompt: put first in every conversation as a ``system`` message (None: none).
      tools: tool schemas (OpenAI function format) passed to the template as ``tools=``; None
        or empty: not passed.

    Attributes:
      end_of_turn_id: the token the template closes an assistant turn with, when that is a
        special token (``<|im_end|>``, ``<|eot_id|>``), else None; the collector stops
        sampling on it by default.
      probe: ``{probe name: "ok" | "differs" | "error: <message>"}`` for the probe
        conversations ``plain``, ``tool`` and ``reasoning``. "error" means the template
        cannot render that kind of conversation (no tool role, say); the collector fails with
        the template's message only if an env actually sends such a message.
      prefix_stable: no probe ``"differs"``.

    Raises:
      ValueError (naming ``rollout.chat``): the codec has no chat template, or the template
        cannot render a user message and an assistant reply.
    """

    def __init__(self, codec, *, system_prompt: str | None = None,
                 tools: Sequence[dict] | None = None):
        if not (getattr(codec, "chat_template", None) and callable(
                getattr(codec, "apply_chat_template", None)) and callable(
                getattr(codec, "render_chat", None))):
            raise _chat_error(
                f"the codec ({type(codec).__name__}) has no chat template; chat rollouts need "
                f"an HF tokenizer whose folder has one (tokenizer_config.json 'chat_template' "
                f"or chat_template.jinja), or set rollout.chat: false")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise _chat_error(f"the system prompt must be a str or None, got "
                              f"{type(system_prompt).__name__}")
        self.codec = codec
        self.system_prompt = system_prompt
        self.tools = _check_tools(tools)
        self._kwargs = {"tools": self.tools} if self.tools else {}
        probe = self._cached_probe()
        self.end_of_turn_id = probe.end_of_turn_id
        self.probe = dict(probe.results)
        self.prefix_stable = "differs" not in self.probe.values()
        self.silent_roles = self._silent_roles()

    def _silent_roles(self) -> tuple:
        """The observation roles (``user``, ``tool``) whose message content the template
        leaves out of its render (a template without a branch for that role renders it as
        nothing): an agent would never see such an observation. A role the template refuses
        outright is not listed (rendering it fails with the template's own message)."""
        out = []
        for role in ("user", "tool"):
            marker = "zq" + role + "7x"
            msgs = [{"role": "user", "content": _STAND_IN_USER},
                    {"role": "assistant", "content": "ok"}, {"role": role, "content": marker}]
            try:
                text = self.codec.render_chat(self.conversation(msgs),
                                              add_generation_prompt=True, **self._kwargs)
            except Exception:  # noqa: BLE001 - refused: reported when it is rendered
                continue
            if marker not in text:
                out.append(role)
        return tuple(out)

    # --------------------------------------------------------------------------- rendering

    def conversation(self, messages: Sequence[dict]) -> list[dict]:
        """``[system?] + messages``: the whole message list the template renders."""
        head = [{"role": "system", "content": self.system_prompt}] \
            if self.system_prompt is not None else []
        return head + [dict(m) for m in messages]

    def render_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True
                   ) -> list[int]:
        """The template's ids of ``[system?] + messages`` (with this template's tools)."""
        try:
            ids = self.codec.apply_chat_template(self.conversation(messages),
                                                 add_generation_prompt=add_generation_prompt,
                                                 **self._kwargs)
        except Exception as e:  # the template's own raise_exception, a missing role, ...
            raise _chat_error(f"the chat template failed to render the conversation (roles "
                              f"{[m.get('role') for m in messages]}): {e}") from e
        return [int(i) for i in ids]

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """Turn 0's prompt: the render of ``[system?] + messages`` with the generation
        prompt."""
        return self.render_ids(messages, add_generation_prompt=True)

    def continuation(self, messages: Sequence[dict], after: Sequence[int] = (),
                     add_generation_prompt: bool = True) -> list[int]:
        """The ids that follow an assistant turn whose sampled ids end with ``after``: the
        template's close of the assistant turn (less its end-of-turn token when ``after``
        ends with it), the render of ``messages``, and the generation prompt (when
        ``add_generation_prompt``). Rendered on the stand-in conversation (module
        docstring), never from the real history."""
        ids = self.codec.encode(self._tail(messages, add_generation_prompt))
        ids = [int(i) for i in ids]
        eot = self.end_of_turn_id
        if eot is not None and ids and ids[0] == eot and len(after) and int(after[-1]) == eot:
            ids = ids[1:]
        return ids

    def _stand_in(self, marker: str, messages) -> list[dict]:
        return ([{"role": "user", "content": _STAND_IN_USER},
                 {"role": "assistant", "content": marker}] + [dict(m) for m in messages])

    def _render_text(self, messages, add_generation_prompt: bool) -> str:
        try:
            return self.codec.render_chat(self.conversation(messages),
                                          add_generation_prompt=add_generation_prompt,
                                          **self._kwargs)
        except Exception as e:
            raise _chat_error(f"the chat template failed to render the conversation (roles "
                              f"{[m.get('role') for m in messages]}): {e}") from e

    def _split(self, messages, add_generation_prompt: bool) -> tuple[str, int]:
        """The stand-in conversation's text and the offset right after the assistant's
        marker."""
        for marker in _MARKERS:
            if any(marker in str(m.get("content", "")) for m in messages):
                continue
            text = self._render_text(self._stand_in(marker, messages), add_generation_prompt)
            if text.count(marker) == 1:
                return text, text.index(marker) + len(marker)
        raise _chat_error("the chat template does not render an assistant message's content "
                          "verbatim, so the tokens after an assistant turn cannot be found")

    def _tail(self, messages, add_generation_prompt: bool) -> str:
        text, cut = self._split(messages, add_generation_prompt)
        return text[cut:]

    # ------------------------------------------------------------------------------- probe

    def _cached_probe(self) -> _Probe:
        key = (self.codec.chat_template, self.system_prompt,
               json.dumps(self.tools, sort_keys=True, default=str))
        try:
            per_codec = _PROBE_CACHE.setdefault(self.codec, {})
        except TypeError:  # not weak-referenceable: probe every time
            per_codec = {}
        if key not in per_codec:
            per_codec[key] = self._run_probe()
        return per_codec[key]

    def _run_probe(self) -> _Probe:
        user = [{"role": "user", "content": "Hi"}]
        self.render_ids(user)  # raises the clear error when even this fails
        # the close of an assistant turn, and whether its first token is a special token
        close = [int(i) for i in self.codec.encode(self._tail([], False))]
        eot = close[0] if close and _is_special(self.codec, close[0]) else None
        self.end_of_turn_id = eot  # continuation() reads it while replaying the probes
        results = {}
        for name, script in _PROBES:
            try:
                results[name] = "ok" if self._replay(script) else "differs"
            except ValueError as e:
                results[name] = f"error: {e}"
        return _Probe(eot, results)

    def _replay(self, script) -> bool:
        """Runs the collector's bookkeeping over a scripted conversation (actions encoded as
        a sampler would emit them, end-of-turn token included) and compares every prompt and
        the split of the stand-in render with the template's own ids."""
        messages = list(script[0][0])
        held = self.prompt(messages)
        ok = True
        for k, (_, reply) in enumerate(script):
            sampled = [int(i) for i in self.codec.encode(reply)]
            if self.end_of_turn_id is not None:
                sampled.append(self.end_of_turn_id)
            held = held + sampled
            messages.append({"role": "assistant", "content": reply})
            if k + 1 < len(script):
                new = script[k + 1][0]
                text, cut = self._split(new, True)
                enc = self.codec.encode
                if list(enc(text)) != list(enc(text[:cut])) + list(enc(text[cut:])):
                    ok = False  # the tail does not start at a token boundary
                held = held + self.continuation(new, sampled)
                messages.extend(new)
                ok = ok and held == self.render_ids(messages)
        return ok


def _check_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, dict)) or not isinstance(tools, Sequence):
        raise _chat_error(f"the env's tools must be a list of JSON schemas (dicts), got "
                          f"{type(tools).__name__}")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise _chat_error(f"the env's tools[{i}] must be a dict (a JSON schema in the "
                              f"OpenAI function format), got {type(t).__name__}")
        out.append(t)
    return out


def _is_special(codec, token_id: int) -> bool:
    """Whether ``token_id`` is a special token (it decodes to nothing when special tokens
    are skipped)."""
    try:
        return codec.decode([token_id], skip_special_tokens=True) == "" and \
            codec.decode([token_id]) != ""
    except TypeError:  # a decode without skip_special_tokens
        return False


def warn_if_unstable(template: ChatTemplate, stacklevel: int = 2) -> None:
    """One ``ChatTemplateWarning`` per template text and process when ``template`` is not
    prefix-stable, saying what the collector does about it (``stacklevel`` as in
    ``warnings.warn``, counted from the caller of this function)."""
    if template.prefix_stable:
        return
    text = template.codec.chat_template
    if text in _WARNED:
        return
    _WARNED.add(text)
    which = ", ".join(k for k, v in template.probe.items() if v == "differs")
    warnings.warn(
        f"rollout.chat: the chat template is not prefix-stable (probe conversations: {which}): "
        f"its render of a whole conversation differs from the ids the collector holds, e.g. it "
        f"rewrites earlier assistant turns. Training uses the ids as held (the sampled ids "
        f"verbatim, every prompt exactly what the sampler saw); only the template's re-render "
        f"of the history differs. The collection stats count affected trajectories "
        f"(chat_rerender_differs).", ChatTemplateWarning, stacklevel=stacklevel + 1)
