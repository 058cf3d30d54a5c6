"""The ``toolbox`` MCP server: a calculator and a key-value notebook, over stdio.

Tools (all arguments required, all results text):

- ``calculate(expression: str)``: the integer value of an expression over integers, ``+ - *``,
  unary minus and parentheses (at most 200 characters, |intermediate values| <= 10**15). A bad
  expression gives an error result ("error: ...").
- ``notebook_write(key: str, value: str)``: stores ``value`` under ``key`` (keys and values at
  most 200 characters, at most 256 keys); returns ``"ok"``.
- ``notebook_read(key: str)``: the value stored under ``key``, or an error result when there is
  none.
- ``notebook_clear()``: forgets every key; returns ``"ok"``.

The notebook lives as long as the process. Run it with ``python -m
jaxrl_agent.envs.mcp_servers.toolbox`` or by path (faster: it imports only the standard library
and the ``mcp`` package). The expression evaluator walks Python's ``ast`` of the expression and
accepts only the nodes above: it never calls ``eval``.
"""

from __future__ import annotations

import ast
import functools

MAX_EXPRESSION = 200
MAX_VALUE = 10**15
MAX_TEXT = 200
MAX_KEYS = 256


class ToolboxError(ValueError):
    """A bad tool argument (reported to the client as an error result)."""


def calculate_value(expression: str) -> int:
    """The integer value of ``expression`` (grammar in the module docstring); ToolboxError
    otherwise."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolboxError("empty expression")
    if len(expression) > MAX_EXPRESSION:
        raise ToolboxError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise ToolboxError(f"bad expression ({type(e).__name__})") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            out = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            out = -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
            a, b = value(node.left), value(node.right)
            out = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) \
                else a * b
        else:
            raise ToolboxError("only integers, + - * and parentheses are allowed")
        if abs(out) > MAX_VALUE:
            raise ToolboxError("value too large")
        return out

    return value(tree.body)


def _text(name: str, value) -> str:
    if not isinstance(value, str):
        raise ToolboxError(f"{name} must be a string")
    if len(value) > MAX_TEXT:
        raise ToolboxError(f"{name} longer than {MAX_TEXT} characters")
    return value


def build_server():
    """The server object (the ``mcp`` SDK's ``MCPServer``, or ``FastMCP`` on mcp 1.x) with the
    four tools registered."""
    try:
        from mcp.server.mcpserver import MCPServer as Server
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server
        from mcp.server.fastmcp.exceptions import ToolError

    server = Server("jaxrl-agent-toolbox")
    notebook: dict[str, str] = {}

    def reported(fn):
        """Turns ToolboxError into the SDK's ToolError, whose message reaches the client."""
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except ToolboxError as e:
                raise ToolError(str(e)) from None
        return functools.wraps(fn)(wrapper)

    @server.tool()
    @reported
    def calculate(expression: str) -> str:
        """Evaluate an integer expression with + - * and parentheses, e.g. "12*(3+4)"."""
        return str(calculate_value(expression))

    @server.tool()
    @reported
    def notebook_write(key: str, value: str) -> str:
        """Store a text value under a key in the notebook."""
        key, value = _text("key", key), _text("value", value)
        if key not in notebook and len(notebook) >= MAX_KEYS:
            raise ToolboxError(f"the notebook is full ({MAX_KEYS} keys)")
        notebook[key] = value
        return "ok"

    @server.tool()
    @reported
    def notebook_read(key: str) -> str:
        """Read the value stored under a key in the notebook."""
        key = _text("key", key)
        if key not in notebook:
            raise ToolboxError(f"no key {key!r} in the notebook")
        return notebook[key]

    @server.tool()
    def notebook_clear() -> str:
        """Forget every key in the notebook."""
        notebook.clear()
        return "ok"

    return server


def main() -> None:
    import logging
    logging.basicConfig(level=logging.WARNING)
    build_server().run()


if __name__ == "__main__":
    main()
