"""f32 -> Q2_K..Q6_K, IQ4_XS, NVFP4 (fleetd/compute/quantizers.py), the CPU backend's from_float.

Three checks: the bytes equal ggml's reference quantizers (digests of ggml-quants.c's output,
built as ggml-base is, for a fixed sample), the round trip through gguf's dequantizers loses no
more than each format's level spacing allows, and llama.cpp's test-backend-ops passes CPY and
SET_ROWS into each type on fleetd.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import needs_tool

from fleetd.compute import quantizers
from fleetd.compute.dequant import QUANTIZABLE, dequantize, quantize
from fleetd.wire import TYPE_TRAITS, GgmlType

# type: (test-backend-ops name, sha256 prefix of ggml's reference output for sample_rows(1234),
#        largest RMS error relative to the data's RMS for uniform data)
TYPES = {
    GgmlType.Q2_K: ("q2_K", "fde1646b551b98bd3f1ba5d4", 0.27),
    GgmlType.Q3_K: ("q3_K", "70aad6881dbaac4a09fc2008", 0.15),
    GgmlType.Q4_K: ("q4_K", "a2da7ccc0ce95882dbf3bf68", 0.07),
    GgmlType.Q5_K: ("q5_K", "0fc215cafef5b6c993e70109", 0.035),
    GgmlType.Q6_K: ("q6_K", "2ee6ccd813f189a0edf23ae8", 0.017),
    GgmlType.IQ4_XS: ("iq4_xs", "62f5cdaf6d7d7fb903b27a82", 0.08),
    GgmlType.NVFP4: ("nvfp4", "ae8c26a5161c2a7cf5557c45", 0.12),
}
PARAMS = list(TYPES)
IDS = [name for name, _, _ in TYPES.values()]


def sample_rows(block: int, seed: int) -> np.ndarray:
    """One block per row: uniform, wide, heavy-tailed over twelve decades, integer valued (ties),
    zero, constant, one-signed, and blocks with a single outlier."""
    rng = np.random.default_rng(seed)
    rows = [
        rng.uniform(-1, 1, (24, block)),
        rng.uniform(-150, 150, (8, block)),
        rng.standard_t(2, (8, block)) * 10.0 ** rng.integers(-6, 5, (8, 1)),
        np.round(rng.normal(0, 3, (4, block))),
        np.zeros((1, block)),
        np.full((1, block), 0.37),
        np.full((1, block), -2.5),
        np.abs(rng.normal(0, 1, (2, block))),
        -np.abs(rng.normal(0, 1, (2, block))),
    ]
    spiky = rng.uniform(-1, 1, (4, block))
    spiky[np.arange(4), rng.integers(0, block, 4)] = [40, -40, 1e4, -3e-3]
    rows.append(spiky)
    return np.concatenate(rows).astype(np.float32)


def round_trip(values: np.ndarray, type_: int) -> np.ndarray:
    return dequantize(np, quantize(np, values, type_), type_)


@pytest.mark.parametrize("type_", PARAMS, ids=IDS)
def test_bytes_match_ggml_reference(type_):
    block = TYPE_TRAITS[type_].blck_size
    packed = quantize(np, sample_rows(block, 1234), type_)
    assert packed.shape == (55, TYPE_TRAITS[type_].type_size)
    assert hashlib.sha256(packed.tobytes()).hexdigest()[:24] == TYPES[type_][1]


@pytest.mark.parametrize("type_", PARAMS, ids=IDS)
def test_registered_for_cpy_and_set_rows(type_):
    assert type_ in QUANTIZABLE


@pytest.mark.parametrize("type_", PARAMS, ids=IDS)
def test_round_trip_error_within_level_spacing(type_):
    values = np.random.default_rng(5).uniform(-1, 1, (16, 1024)).astype(np.float32)
    restored = round_trip(values, type_)
    assert restored.shape == values.shape
    relative_rms = np.sqrt(np.mean((restored - values) ** 2) / np.mean(values**2))
    assert relative_rms < TYPES[type_][2]


@pytest.mark.parametrize("type_", PARAMS, ids=IDS)
def test_zero_and_constant_blocks(type_):
    block = 256
    rows = np.array(
        [np.zeros(block), np.full(block, 0.37), np.full(block, -2.5), np.full(block, 3.0)], np.float32
    )
    restored = round_trip(rows, type_)
    assert np.all(restored[0] == 0)
    # a constant is one level times an fp16 (or UE4M3) scale: within the scale's rounding
    tolerance = 0.05 if type_ == GgmlType.NVFP4 else 2e-3
    np.testing.assert_allclose(restored[1:], rows[1:], rtol=tolerance)


@pytest.mark.parametrize("type_", PARAMS, ids=IDS)
def test_outlier_keeps_its_value_and_the_rest_stays_bounded(type_):
    rows = np.random.default_rng(9).uniform(-1, 1, (4, 256)).astype(np.float32)
    spikes = [40.0, -40.0, 1e3, 7.5]  # NVFP4 saturates near 2688 (UE4M3 scale 224 x 12)
    rows[np.arange(4), [3, 100, 255, 17]] = spikes
    restored = round_trip(rows, type_)
    np.testing.assert_allclose(restored[np.arange(4), [3, 100, 255, 17]], spikes, rtol=0.1)
    # nothing comes back larger than the block's own extreme (plus fp16 rounding of the scale)
    assert np.all(np.abs(restored) <= np.abs(rows).max(axis=1, keepdims=True) * 1.05)


def test_tiny_blocks_quantize_to_zero_without_warnings():
    # below GROUP_MAX_EPS the symmetric types write zero scales, as ggml does
    rows = np.full((2, 256), 1e-17, np.float32)
    with np.errstate(all="raise"):
        for type_ in (GgmlType.Q3_K, GgmlType.Q6_K, GgmlType.IQ4_XS):
            assert np.all(round_trip(rows, type_) == 0)


def test_nearest_int_rounds_half_to_even():
    assert list(quantizers.nearest_int(np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998], np.float32))) == [
        0,
        2,
        2,
        0,
        -2,
        2,
    ]


# ---- test-backend-ops on fleetd: every CPY and SET_ROWS case into each type -------------------


@pytest.fixture(scope="module")
def backend_ops():
    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("backend_ops", repo / "scripts" / "backend_ops.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fleetd_process(backend_ops, tmp_path_factory):
    server = backend_ops.Server("fleetd", tmp_path_factory.mktemp("quantizers-backend-ops"), device="numpy")
    server.ensure()
    yield server
    server.stop()


@needs_tool("test-backend-ops")
@pytest.mark.parametrize("op", ["CPY", "SET_ROWS"])
@pytest.mark.parametrize("type_", PARAMS, ids=IDS)
def test_backend_ops_into_type_pass_on_fleetd(backend_ops, fleetd_process, tmp_path, op, type_):
    params = f"type_dst={TYPES[type_][0]},"
    result = backend_ops.run_op(fleetd_process, op, params, timeout=300, log=tmp_path / "tbo.log")
    assert result.failed == 0, "\n".join(result.failures[:10])
    assert result.passed > 0, f"no {op} case matched -p {params!r}"
