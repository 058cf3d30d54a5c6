"""Arithmetic tool use: compute ``a op b op c`` with a calculator tool over several turns.

Task: ``a op1 b op2 c`` with ``a, b, c`` in ``[lo, hi]`` and ops in ``+ - *`` (usual precedence).
Observation: the task, then the known tool results (sorted, at most the last ``show_known``)::

    compute 7+8*13
    8*13=104

Actions (case/whitespace tolerant):
  ``calc <expr>``   tool call; ``<expr>`` uses integers, ``+ - *`` and parentheses. The tool's
                    reply is added to the observation (``<expr>=<value>``) or, for a bad
                    expression, the observation's last line is ``error: bad expression``.
                    Aliases: ``calc: <expr>``, ``calculate <expr>``, ``= <expr>``.
  ``answer <int>``  ends the episode; reward 1.0 if correct, else 0.0. Alias ``answer: <int>``.
Anything else is an invalid action. Episodes end at ``max_turns`` (default 6).

Expressions are evaluated by a small recursive-descent parser (:func:`evaluate`), never ``eval``;
they are limited to 64 characters and |values| <= 10**9.
``state_key = "calc:<task>|<sorted set of known intermediate values>"``.
The solver calls the higher-precedence operation first, then the other one, then answers
(3 turns).
"""

from __future__ import annotations

import re

from jaxrl_agent.envs.base import Env, Task, register, split_of

OPS = ("+", "-", "*")
MAX_LEN = 64
MAX_ABS = 10**9


class ParseError(ValueError):
    pass


def _tokenize(text: str) -> list[str]:
    if len(text) > MAX_LEN:
        raise ParseError("expression too long")
    toks = re.findall(r"\d+|[+\-*()]|\S", text)
    for t in toks:
        if not (t.isdigit() or t in "+-*()"):
            raise ParseError(f"unexpected character {t!r}")
    if not toks:
        raise ParseError("empty expression")
    return toks


def evaluate(text: str) -> int:
    """Integer value of an expression over ``+ - *``, unary minus and parentheses.

    Grammar: ``expr := term (('+'|'-') term)*``, ``term := factor ('*' factor)*``,
    ``factor := INT | '-' factor | '(' expr ')'``. Raises ``ParseError`` on anything else.
    """
    toks = _tokenize(text)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        t = peek()
        pos += 1
        return t

    def check(v):
        if abs(v) > MAX_ABS:
            raise ParseError("value too large")
        return v

    def expr():
        v = term()
        while peek() in ("+", "-"):
            v = check(v + term() if take() == "+" else v - term())
        return v

    def term():
        v = factor()
        while peek() == "*":
            take()
            v = check(v * factor())
        return v

    def factor():
        t = take()
        if t is None:
            raise ParseError("unexpected end")
        if t.isdigit():
            if len(t) > 10:
                raise ParseError("number too long")
            return check(int(t))
        if t == "-":
            return -factor()
        if t == "(":
            v = expr()
            if take() != ")":
                raise ParseError("missing ')'")
            return v
        raise ParseError(f"unexpected token {t!r}")

    v = expr()
    if pos != len(toks):
        raise ParseError(f"unexpected token {toks[pos]!r}")
    return v


_INT = re.compile(r"^[+-]?\d{1,12}$")


class Calculator(Env):
    family = "calculator"
    default_max_turns = 6

    def __init__(self, lo: int = 2, hi: int = 20, show_known: int = 4,
                 max_turns: int | None = None, invalid_penalty: float = -0.1,
                 invalid_ends: bool = False, step_latency_s: float = 0.0):
        super().__init__(max_turns, invalid_penalty, invalid_ends, step_latency_s)
        if not 0 <= lo < hi:
            raise ValueError(f"need 0 <= lo < hi, got lo={lo}, hi={hi}")
        self.lo, self.hi, self.show_known = int(lo), int(hi), int(show_known)

    def _config(self):
        return dict(super()._config(), lo=self.lo, hi=self.hi, show_known=self.show_known)

    def _make_task(self, rng) -> Task:
        a, b, c = (rng.randint(self.lo, self.hi) for _ in range(3))
        op1, op2 = rng.choice(OPS), rng.choice(OPS)
        text = f"{a}{op1}{b}{op2}{c}"
        # the solver's plan: the higher-precedence (or leftmost) operation first
        if op2 == "*" and op1 != "*":
            first = f"{b}*{c}"
            second = f"{a}{op1}{evaluate(first)}"
        else:
            first = f"{a}{op1}{b}"
            v = evaluate(first)
            second = f"{v}{op2}{c}" if v >= 0 else f"({v}){op2}{c}"
        data = {"expr": text, "value": evaluate(text), "plan": (first, second)}
        return Task(self.family, text, split_of(text), data)

    def _reset(self, task):
        self.known: dict[str, int] = {}
        self.last_error = False

    def _parse(self, text):
        m = re.match(r"^(calc|calculate|=)\s*:?\s*(.+)$", text)
        if m:
            return ("calc", m.group(2))
        m = re.match(r"^answer\s*[:=]?\s*(\S+)$", text)
        if m and _INT.match(m.group(1)):
            return ("answer", int(m.group(1)))
        return None

    def _apply(self, parsed):
        kind, arg = parsed
        self.last_error = False
        if kind == "calc":
            try:
                v = evaluate(arg)
            except ParseError:
                self.last_error = True
                return 0.0, False, {"tool_error": True}
            self.known["".join(arg.split())] = v
            return 0.0, False, {"tool_value": v}
        ok = arg == self.task.data["value"]
        return (1.0 if ok else 0.0), True, {"success": ok}

    def observation(self) -> str:
        lines = [f"compute {self.task.data['expr']}"]
        lines += [f"{e}={v}" for e, v in sorted(self.known.items())][-self.show_known:] \
            if self.show_known else []
        if self.last_error:
            lines.append("error: bad expression")
        return "\n".join(lines)

    def state_key(self) -> str:
        vals = ",".join(str(v) for v in sorted(set(self.known.values())))
        return f"calc:{self.task.key}|{vals}"

    def solver(self) -> str:
        first, second = self.task.data["plan"]
        values = set(self.known.values())
        if evaluate(first) not in values:
            return f"calc {first}"
        if evaluate(second) not in values:
            return f"calc {second}"
        return f"answer {self.task.data['value']}"


register("calculator", Calculator)
