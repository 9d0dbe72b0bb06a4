"""llama.cpp's own test-backend-ops (pinned tree) against fleetd: a representative subset.

Each case builds a ggml graph, runs it on fleetd through the stock RPC client and on ggml's CPU
backend, and compares (NMSE). The full set runs from `scripts/backend_ops.py`
(results in docs/op-coverage.md); here a few cases per op family that llama / qwen3 /
qwen3moe / gemma3 graphs use, picked with test-backend-ops' own `-p` filters.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import REPO, needs_tool

pytestmark = needs_tool("test-backend-ops")

_spec = importlib.util.spec_from_file_location("backend_ops", REPO / "scripts" / "backend_ops.py")
backend_ops = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = backend_ops  # dataclasses look their module up
_spec.loader.exec_module(backend_ops)

# (op, -p regex over the case's params): small shapes, the types llama.cpp sends.
SUBSET = [
    ("ADD", r"type=f32,ne=\[10,5,4,3\],nr=\[2,2,2,2\]"),
    ("MUL", r"type=f16,ne=\[10,5,4,3\]"),
    ("DIV", r"type=f32,ne=\[10,5,4,3\],nr=\[1,1,1,1\],nf=1"),
    ("ADD_ID", r"type_a=f32,type_b=f32,n_embd=129,n_experts=8,n_experts_used=4,n_token=1$"),
    ("SCALE", r"ne=\[10,10,10,10\]"),
    ("GET_ROWS", r"type=(f16|q4_0|q8_0),n=256,m=5,r=4,be1=1,be2=1,v=0"),
    ("SET_ROWS", r"type_dst=(f16|q8_0|q4_0),type_idx=i64,ne=\[256,5,1,3\]"),
    ("CPY", r"type_src=f32,type_dst=(f16|bf16|q8_0|q4_0|q5_1),ne_src=\[256,4,4,4\]"),
    # same-type block copies from a permuted src0 (and into a permuted result)
    (
        "CPY",
        r"type_src=(q4_K|iq4_xs|nvfp4),type_dst=(q4_K|iq4_xs|nvfp4),ne_src=\[256,2,3,4\],permute_src=\[0,[23],",
    ),
    ("CONT", r"type=f32,ne=\[10,10,10,1\]"),
    ("RMS_NORM", r"type=f32,ne=\[64,5,4,3\],v=0"),
    ("NORM", r"type=f32,ne=\[64,5,4,3\],v=0"),
    ("L2_NORM", r"ne=\[64,5,4,3\]"),
    (
        "MUL_MAT",
        r"type_a=(f16|bf16|q8_0|q4_0|q4_K|q6_K|iq4_nl),type_b=f32,m=16,n=(1|9),k=256,bs=\[1,1\],nr=\[1,1\],per=\[0,1,2,3\],k_v=0,o=1",
    ),
    ("MUL_MAT", r"type_a=f32,type_b=bf16,"),  # bf16 src1 widened for f32 weights
    ("MUL_MAT_HADAMARD", r"type_a=f32,type_b=(f32|f16),m=(64|128),n=(1|4),"),
    ("MUL_MAT_ID", r"type_a=(q4_K|q6_K|q8_0),type_b=f32,n_mats=4,n_used=2,b=0,m=512,n=1,k=256"),
    (
        "ROPE",
        r"type=f32,ne_a=\[128,32,2,1\],n_dims=128,mode=(0|2),n_ctx=512,fs=1.000000,ef=0.000000,af=1.000000,ff=0,v=0",
    ),
    (
        "SOFT_MAX",
        r"type=f32,ne=\[32,2,32,1\],mask=1,sinks=(0|1),m_prec=f16,nr23=\[1,1\],scale=0.100000,max_bias=(0.000000|8.000000)",
    ),
    (
        "FLASH_ATTN_EXT",
        r"hsk=64,hsv=64,nh=4,nr23=\[4,1\],kv=512,nb=(1|3),mask=1,sinks=(0|1),max_bias=0.000000,logit_softcap=0.000000,prec=f32,type_K=f16,type_V=f16,permute=\[0,1,2,3\]",
    ),
    ("SWIGLU", r"type=f32,ne_a=\[128,2,2,2\]"),
    ("GEGLU", r"type=f32,ne_a=\[128,2,2,2\],v=0,swapped=1"),
    ("GELU", r"type=f32"),
    ("SILU", r"type=f32"),
    ("SUM_ROWS", r"type=f32,ne=\[10,5,4,3\]"),
    ("MEAN", r"type=f32"),
    ("ARGMAX", r"type=f32,ne=\[32,1,1,1\]"),
    ("ARGSORT", r"type=f32,ne=\[16,10,10,10\]"),
    ("TOP_K", r"type=f32,ne=\[16,10,10,10\],k=3"),
    ("CONCAT", r"type=f32,ne_a=\[11,12,13,14\],ne_b_d=7,dim=(0|2),v=0"),
    ("PAD", r"type=f32,ne_a=\[512,512,1,1\]"),
    ("CLAMP", r"type=f32"),
]


@pytest.fixture(scope="module", params=["numpy", "cpu"])
def fleetd_process(request, tmp_path_factory):
    """fleetd on the numpy op table, and on ggml's CPU kernels (the default device)."""
    server = backend_ops.Server("fleetd", tmp_path_factory.mktemp("backend-ops"), device=request.param)
    server.ensure()
    yield server
    server.stop()


@pytest.mark.parametrize(("op", "params"), SUBSET, ids=[op for op, _ in SUBSET])
def test_backend_ops_subset_passes_on_fleetd(fleetd_process, tmp_path, op, params):
    result = backend_ops.run_op(fleetd_process, op, params, timeout=300, log=tmp_path / "tbo.log")
    assert result.failed == 0, "\n".join(result.failures[:10])
    assert result.passed > 0, f"no {op} case matched -p {params!r}"


@needs_tool("ggml-rpc-server")
def test_one_process_through_fleetd_reaches_every_case_stock_passes(tmp_path):
    """As a user runs it: GET_ROWS, SET_ROWS and MUL_MAT_ID (q4_0) in ONE test-backend-ops
    process per server, fleetd with a 1 s request grace. The client spends seconds between
    requests computing its CPU reference; before the slow-sender clock counted only recv waits,
    fleetd charged that to the next request and cut the client, losing every later case."""
    results = {}
    for kind, extra in (("fleetd", ["--request-timeout", "1"]), ("stock", [])):
        server = backend_ops.Server(kind, tmp_path, "cpu", extra)
        try:
            results[kind] = backend_ops.run_one_process(
                server, ["GET_ROWS", "SET_ROWS", "MUL_MAT_ID"], "q4_0", 1800, tmp_path / f"{kind}.log"
            )
        finally:
            server.stop()
    for op, stock in results["stock"].items():
        ours = results["fleetd"][op]
        assert stock.passed > 0 and ours.not_reached == 0, (op, ours.failures[:3])
        assert ours.passed == stock.passed and ours.failed == 0, (op, ours.failures[:3])
