"""What many test files share: the one gate for tests that need a built llama.cpp tool, a
server's endpoint. Fixtures are in conftest.py.

    pytestmark = needs_tool("ggml-rpc-server")            # a whole file
    @needs_tool("p2p/llama-completion", "ggml-rpc-server")  # one test: the patched client, stock server
"""

from __future__ import annotations

import pytest

from fleetd.tools import find_p2p_tool, find_tool

# A tool name is a stock tool (scripts/build-llama.sh), or p2p/<name>: the client half with the
# P2P patch (scripts/build-llama-p2p.sh), whose llama-completion differs from the stock one.
P2P_PREFIX = "p2p/"
BUILD_SCRIPT = {False: "scripts/build-llama.sh", True: "scripts/build-llama-p2p.sh"}


def missing_tools(*names: str) -> str | None:
    """Why a test needing `names` cannot run ("needs llama-bench (scripts/build-llama.sh)"),
    or None when every one is built."""
    missing: dict[bool, list[str]] = {False: [], True: []}
    for name in names:
        p2p = name.startswith(P2P_PREFIX)
        try:
            if p2p:
                find_p2p_tool(name[len(P2P_PREFIX):])
            else:
                find_tool(name)
        except FileNotFoundError:
            missing[p2p].append(name)
    parts = [f"{', '.join(tools)} ({BUILD_SCRIPT[p2p]})" for p2p, tools in missing.items() if tools]
    return f"needs {' and '.join(parts)}" if parts else None


def needs_tool(*names: str) -> pytest.MarkDecorator:
    """The mark of a test that runs built llama.cpp tools: conftest.py skips it, naming the
    missing tools and the script that builds them. `pytest -m "not needs_tool"` runs the rest."""
    return pytest.mark.needs_tool(*names)


def skip_unless_built(*names: str) -> None:
    """For fixtures that start a tool (the tests that use them may not carry the mark)."""
    reason = missing_tools(*names)
    if reason is not None:
        pytest.skip(reason)


def endpoint(srv) -> str:
    """host:port of an in-process fleetd (conftest.py's fleetd_server, ggml_server)."""
    return f"{srv.address[0]}:{srv.address[1]}"
