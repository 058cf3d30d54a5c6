"""Small MCP servers shipped with the package, each runnable over stdio.

``toolbox`` (a calculator and a key-value notebook) serves the built-in tasks of the ``mcp``
environment::

    python -m jaxrl_agent.envs.mcp_servers.toolbox       # or, faster to start (no package import):
    python path/to/jaxrl_agent/envs/mcp_servers/toolbox.py

The server modules import only the standard library and the ``mcp`` package (the optional extra
``pip install 'jaxrl-agent[mcp]'``), so running one by path starts in well under a second.
"""

import os
import sys

TOOLBOX_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toolbox.py")


def toolbox_command() -> list[str]:
    """The command that starts the ``toolbox`` server with this interpreter (run by path, which
    skips importing the package and its JAX dependency)."""
    return [sys.executable, TOOLBOX_PATH]
