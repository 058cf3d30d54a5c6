"""The teacher of a run: the ``teacher`` source of ``train.inputs`` (its log-probs of the sampled
tokens, computed in the train step).

``teacher.source``:

==========  ==================================================================================
base        the policy's weights as the run started (after the warm-up), frozen: a copy of
            the trained parameters (with LoRA: the adapters at their start, which are zero,
            so the teacher is the base model with its adapters off; the copy is adapter-sized)
live        the policy at the start of each step (no copy; one forward pass)
ema         a moving average of the policy, ``t <- d t + (1 - d) theta`` after each step
            (``teacher.ema_decay`` d; one copy of the trained parameters, checkpointed)
PATH        another checkpoint: an HF folder, or a run directory's ``final_model``; any
            architecture the loader reads, with the student's tokenizer (checked at start-up)
==========  ==================================================================================

The step scores the sampled tokens under the teacher with the rollouts' temperature / top-k /
top-p (the distribution the student sampled from; ``teacher.temperature`` scores it at another
temperature, e.g. a sharpened copy of the start weights), chunked over positions (never [rows,
T, vocab] logits), under ``stop_gradient``. Nothing of the teacher is trained.

A privileged context (on-policy self-distillation): ``teacher.system_prompt`` (a fixed text)
and / or ``teacher.context: true`` (the environment's per-task text, ``Env.teacher_context``,
recorded with each trajectory as ``teacher_context``) are placed in the teacher's prompt only:
``teacher_records`` writes the teacher's view of each record (the context's tokens after the
prompt's leading prefix, e.g. BOS, of the first observation in the concatenated layout and of
every turn's prompt in the per-step layout), the trainer packs it into the same rows as the
policy's batch, and the step moves the teacher's log-probs onto the policy's action tokens
(``segments.align_action_tokens``): the same sampled tokens, scored after another prompt.
"""

from __future__ import annotations

from jaxrl_agent import config as config_lib

__all__ = ["TOKENIZER_PROBE", "context_text", "load_teacher", "teacher_records",
           "teacher_summary"]

#: text both tokenizers must encode to the same ids
TOKENIZER_PROBE = ("The agent moves north, opens the door (key #3) and answers: 42.\n"
                   "Ünïcödé — 日本語 🙂 <tool_call>{\"x\": [1, 2]}</tool_call>")

_SAY = {"base": "the policy's start weights, frozen (LoRA: adapters off)",
        "live": "the policy at the start of each step",
        "ema": "a moving average of the policy (decay {d:g})"}


def load_teacher(cfg: config_lib.RunConfig, student, codec):
    """The teacher model of a run whose ``teacher.source`` is a path (None otherwise), loaded
    in the student's dtype. ``ConfigError`` when it cannot be read, or when its vocabulary
    or tokenizer differs from the student's (log-probs over other token ids would be
    silently meaningless), naming both."""
    if config_lib.teacher_kind(cfg) != "model":
        return None
    from jaxrl_agent.models.hf import load_hf
    from jaxrl_agent.models.tokenizer import load_tokenizer
    folder = config_lib.teacher_folder(cfg)
    try:
        model, mc = load_hf(folder, dtype=cfg.model.dtype)
    except Exception as e:  # noqa: BLE001 - any unreadable checkpoint: one line
        raise config_lib.ConfigError(f"teacher.source: cannot load {folder!r} "
                                     f"({type(e).__name__}: {e})") from None
    student_v = student.config.vocab_size
    if mc.vocab_size != student_v:
        raise config_lib.ConfigError(
            f"teacher.source: the teacher {folder!r} has a vocabulary of {mc.vocab_size} "
            f"tokens, the student ({cfg.model.hf_path or 'the built-in model'}) {student_v}: "
            f"a teacher must share the student's tokenizer")
    try:
        tok = load_tokenizer(folder)
    except Exception as e:  # noqa: BLE001
        raise config_lib.ConfigError(f"teacher.source: cannot read the tokenizer of {folder!r} "
                                     f"({type(e).__name__}: {e}); a teacher must share the "
                                     f"student's tokenizer") from None
    a, b = list(codec.encode(TOKENIZER_PROBE)), list(tok.encode(TOKENIZER_PROBE))
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        raise config_lib.ConfigError(
            f"teacher.source: the teacher's tokenizer ({folder}) and the student's "
            f"({cfg.model.hf_path or 'the byte codec'}) encode the same text differently "
            f"(first difference at token {at}); a teacher must share the student's tokenizer")
    return model


def context_text(cfg: config_lib.RunConfig, record: dict, index: int = 0) -> str:
    """The teacher-only text of one record: ``teacher.system_prompt`` and, with
    ``teacher.context``, the record's ``teacher_context``, one per line, ending in a newline.
    ValueError naming the record when the environment gave it none."""
    parts = [cfg.teacher.system_prompt] if cfg.teacher.system_prompt else []
    if cfg.teacher.context:
        ctx = record.get("teacher_context")
        if not isinstance(ctx, str):
            raise ValueError(f"teacher.context: record {index} (task {record.get('task')!r}) "
                             f"has no teacher_context: the environment must return "
                             f"info['teacher_context'] from reset (Env.teacher_context)")
        parts.append(ctx)
    return "\n".join(parts) + "\n"


def teacher_records(records: list, cfg: config_lib.RunConfig, encode, prefix=(),
                    layout: str = "per_step") -> list:
    """The teacher's view of ``records``: the same turns and actions, with the context's tokens
    (``encode(context_text(...))``) inserted after the prompt's leading ``prefix`` (BOS) in
    the first turn's observation (``concatenated``: the row holds the whole conversation) or
    in every turn's (``per_step``: each row is one turn's prompt). Records are copied."""
    prefix = list(prefix)
    out = []
    for i, rec in enumerate(records):
        ctx = [int(x) for x in encode(context_text(cfg, rec, i))]
        turns = []
        for k, t in enumerate(rec["turns"]):
            if k == 0 or layout == "per_step":
                obs = list(t.get("observation") or [])
                n = len(prefix) if prefix and obs[:len(prefix)] == prefix else 0
                t = dict(t, observation=obs[:n] + ctx + obs[n:])
            turns.append(t)
        out.append(dict(rec, turns=turns))
    return out


def teacher_summary(cfg: config_lib.RunConfig, reads) -> str:
    """One line for the start-up summary: which teacher, how it is scored, and who reads it
    (empty without a teacher)."""
    kind = config_lib.teacher_kind(cfg)
    if kind == "none":
        return ""
    what = (_SAY[kind].format(d=cfg.teacher.ema_decay) if kind in _SAY
            else f"the checkpoint {config_lib.teacher_folder(cfg)}")
    r = cfg.rollout
    topk = "teacher_topk_logprobs" in reads and cfg.teacher.top_k > 0
    unread = (f"; teacher.top_k {cfg.teacher.top_k} is set, but no loss of this run reads the "
              f"top K (loss.aux: [topk_kl]), so it is not computed"
              if cfg.teacher.top_k and not topk else "")
    if "teacher_logprobs" not in reads and not topk:
        return (f"teacher: {what}; no method or loss of this run reads it, so it is not run"
                + unread)
    if config_lib.teacher_has_context(cfg):
        what += (", with a prompt of its own (" + " and ".join(
            (["teacher.system_prompt"] if cfg.teacher.system_prompt else [])
            + (["the task's teacher_context"] if cfg.teacher.context else [])) + ")")
    scored = ("its log-probs of the sampled tokens"
              + (f" and its top {cfg.teacher.top_k} next tokens (before truncation)"
                 if topk else ""))
    t = cfg.teacher.temperature
    temp = (f"at temperature {t:g} (the rollouts' is {r.temperature:g})"
            if t is not None and t != r.temperature
            else f"at the rollouts' temperature {r.temperature:g}")
    return (f"teacher: {what}; {scored} in the train step (JAX, on "
            f"the trainer's mesh, chunked), {temp}"
            + (f", top_k {r.top_k}" if r.top_k else "")
            + (f", top_p {r.top_p:g}" if r.top_p < 1 else "") + ", detached" + unread)
