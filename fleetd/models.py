"""Small deterministic GGUF models for demos and tests, written with the `gguf` package.

    path = generate("llama", "f16", out_dir)     # same bytes on every machine, every run

Weights are seeded normal noise, so text is gibberish, but every op a real model of the family
sends runs, and two servers computing the same graphs must print the same tokens. The
tokenizer is a SentencePiece-style ("llama") vocabulary of byte tokens plus a few pieces.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf

QUANT = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}


@dataclass(frozen=True)
class Shape:
    n_vocab: int
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_layer: int = 4
    n_ctx: int = 512
    n_expert: int = 4
    n_expert_used: int = 2

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def vocabulary() -> tuple[list[bytes], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte tokens, then '▁' pieces for letters and a few words."""
    T = gguf.TokenType
    tokens = [b"<unk>", b"<s>", b"</s>"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>".encode() for b in range(256)]
    types += [T.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581the", "\u2581upon", "\u2581time", "\u2581once", "\u2581of", "on", "er", "in"]
    tokens += [p.encode() for p in pieces]
    types += [T.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def _weights(name: str, shape: tuple[int, ...], scale: float = 0.05) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _add(w: gguf.GGUFWriter, name: str, data: np.ndarray, dtype: str) -> None:
    """Norm vectors stay f32 (as convert_hf_to_gguf keeps them); matrices take `dtype`."""
    if data.ndim == 1 or dtype == "f32":
        w.add_tensor(name, data.astype(np.float32))
    elif dtype == "f16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        qtype = QUANT[dtype]
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _attention(w, i: int, s: Shape, dtype: str, qk_norm: bool) -> None:
    p = f"blk.{i}."
    kv = s.n_head_kv * s.head_dim
    _add(w, p + "attn_norm.weight", 1.0 + _weights(p + "attn_norm", (s.n_embd,)), dtype)
    _add(w, p + "attn_q.weight", _weights(p + "attn_q", (s.n_head * s.head_dim, s.n_embd)), dtype)
    _add(w, p + "attn_k.weight", _weights(p + "attn_k", (kv, s.n_embd)), dtype)
    _add(w, p + "attn_v.weight", _weights(p + "attn_v", (kv, s.n_embd)), dtype)
    _add(w, p + "attn_output.weight", _weights(p + "attn_output", (s.n_embd, s.n_head * s.head_dim)), dtype)
    if qk_norm:
        _add(w, p + "attn_q_norm.weight", 1.0 + _weights(p + "q_norm", (s.head_dim,)), dtype)
        _add(w, p + "attn_k_norm.weight", 1.0 + _weights(p + "k_norm", (s.head_dim,)), dtype)


def _dense_ffn(w, i: int, s: Shape, dtype: str) -> None:
    p = f"blk.{i}."
    _add(w, p + "ffn_norm.weight", 1.0 + _weights(p + "ffn_norm", (s.n_embd,)), dtype)
    _add(w, p + "ffn_gate.weight", _weights(p + "ffn_gate", (s.n_ff, s.n_embd)), dtype)
    _add(w, p + "ffn_up.weight", _weights(p + "ffn_up", (s.n_ff, s.n_embd)), dtype)
    _add(w, p + "ffn_down.weight", _weights(p + "ffn_down", (s.n_embd, s.n_ff)), dtype)


def _moe_ffn(w, i: int, s: Shape, dtype: str) -> None:
    p = f"blk.{i}."
    _add(w, p + "ffn_norm.weight", 1.0 + _weights(p + "ffn_norm", (s.n_embd,)), dtype)
    _add(w, p + "ffn_gate_inp.weight", _weights(p + "router", (s.n_expert, s.n_embd)), "f32")
    _add(w, p + "ffn_gate_exps.weight", _weights(p + "gate_exps", (s.n_expert, s.n_ff, s.n_embd)), dtype)
    _add(w, p + "ffn_up_exps.weight", _weights(p + "up_exps", (s.n_expert, s.n_ff, s.n_embd)), dtype)
    _add(w, p + "ffn_down_exps.weight", _weights(p + "down_exps", (s.n_expert, s.n_embd, s.n_ff)), dtype)


ARCHS = ("llama", "qwen3", "qwen3moe")


def generate(arch: str, dtype: str, out_dir: Path, shape: Shape | None = None) -> Path:
    """Write `<out_dir>/<arch>-<dtype>.gguf` (reused when already there) and return its path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (known: {', '.join(ARCHS)})")
    if dtype not in QUANT:
        raise ValueError(f"unknown type {dtype!r} (known: {', '.join(QUANT)})")
    out = Path(out_dir) / f"{arch}-{dtype}.gguf"
    if out.is_file():
        return out
    tokens, scores, types = vocabulary()
    s = shape or Shape(n_vocab=len(tokens))
    tmp = out.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"fleetd-test-{arch}-{dtype}")
    w.add_context_length(s.n_ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    _add(w, "token_embd.weight", _weights("token_embd", (s.n_vocab, s.n_embd), 0.5), dtype)
    for i in range(s.n_layer):
        _attention(w, i, s, dtype, qk_norm=arch in ("qwen3", "qwen3moe"))
        (_moe_ffn if arch == "qwen3moe" else _dense_ffn)(w, i, s, dtype)
    _add(w, "output_norm.weight", 1.0 + _weights("output_norm", (s.n_embd,)), dtype)
    _add(w, "output.weight", _weights("output", (s.n_vocab, s.n_embd), 0.2), dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out
