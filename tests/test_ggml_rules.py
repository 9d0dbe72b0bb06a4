"""The ggml device (`--device cpu`) refuses what its kernels cannot take:

- every op rule of fleetd/compute/ggml/rules.py, broken one at a time, through fleetd's own
  GraphBuilder/RpcClient: the connection that sent it is closed, the next client is answered;
  the same graph unbroken computes (so a rule that refuses everything fails here);
- the graphs that kill the stock ggml-rpc-server (a failed GGML_ASSERT) do not kill fleetd.
"""

from __future__ import annotations

import pytest
from ggml_cases import (
    CASES,
    cont_dequant,
    get_rows_range,
    group_norm_groups,
    mul_mat_shape,
    mul_mat_type,
    op_past_enum,
    rope_mrope_sections,
    send,
)
from helpers import endpoint, needs_tool

try:
    from fleetd.compute.ggml.device import load_device

    load_device()
except OSError as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"ggml libraries: {exc}", allow_module_level=True)


@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__)
def test_rule_refuses_the_broken_graph_and_serves_the_next(ggml_server, case):
    ep = endpoint(ggml_server)
    assert send(ep, case, bad=False), f"{case.__name__}: the valid graph was refused"
    assert not send(ep, case, bad=True), f"{case.__name__}: the broken graph was computed"
    assert send(ep, case, bad=False), "fleetd did not answer the next client"


# -- against the stock server -------------------------------------------------------------------

STOCK_KILLERS = [
    mul_mat_shape,
    mul_mat_type,
    op_past_enum,
    get_rows_range,
    group_norm_groups,
    rope_mrope_sections,
    cont_dequant,
]  # SIGFPE (division by zero) x2, SIGSEGV


@needs_tool("ggml-rpc-server")
@pytest.mark.parametrize("case", STOCK_KILLERS, ids=lambda f: f.__name__)
def test_graph_that_kills_stock_does_not_kill_fleetd(stock_server, ggml_server, case):
    stock = stock_server()
    send(stock, case, bad=True)
    assert stock_server.proc.wait(timeout=30) != 0, "the stock server survived: not a killer"
    assert not send(endpoint(ggml_server), case, bad=True)
    assert send(endpoint(ggml_server), case, bad=False)
