"""Small deterministic GGUF models for the demo, the end-to-end tests and the benchmarks.

    path = generate("llama", "f16", out_dir)            # same bytes on every machine, every run
    path = generate("qwen3moe", "q4_k", out_dir, "bench")

Families: llama, qwen3 (q/k norms), qwen3moe (8 experts, 2 used), gemma3 (post norms, GELU,
sliding window). Weight types: f32, f16, q8_0 (gguf's quantizer), q4_k (a simple min/scale
quantizer of ours: exact format, not llama-quantize's search; tensors whose rows are not whole
256-blocks fall back to Q8_0 as llama-quantize does). Weights are seeded per family. The
tokenizer is a SentencePiece-style vocabulary with byte fallback, enough for llama.cpp to
tokenize any text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf import quants as gguf_quants


@dataclass(frozen=True)
class Dims:
    """A model's shape: widths, heads, layers, context and, for qwen3moe, the experts."""

    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_layer: int = 2
    n_ctx: int = 2048
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_expert: int = 256


TINY = Dims()  # the end-to-end tests: seconds per model on two cores
BENCH = Dims(n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_layer=8, n_ff_expert=768)  # ~100M params
# The mid-size shape (24 layers, n_embd 768: ~150M params, ~85 MB Q4_K, ~160 MB Q8_0):
# many layers per graph, so per-node graph work shows beside the kernels.
MID = Dims(n_embd=768, n_head=12, n_head_kv=4, n_ff=2048, n_layer=24)
# The lab's model: a hidden state wide enough that moving it costs link time (n_embd 2048, 8 KiB
# per token in f32), few layers so it generates in seconds and loads over a slow link (~50 MB f16).
WIDE = Dims(n_embd=2048, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_layer=3)
# The same, 12 layers: a split over 3 or 4 nodes with the same total model (4 or 3 layers each).
WIDE12 = Dims(n_embd=2048, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_layer=12)
# benchmarks/load.py's models: FFN matrices above the stock client's 10 MiB SET_TENSOR_HASH
# threshold in f16 and in Q8_0 (5632 x 2048), so most of the weights take the cache path;
# ~180M params (~190 MB Q8_0, ~360 MB f16), so load time is the weights.
LOAD = Dims(n_embd=2048, n_head=16, n_head_kv=4, head_dim=128, n_ff=5632, n_layer=4)
# The smallest model with matrices on that path (f16 FFN, 11264 x 512; one layer, ~36 MB f16):
# the test of benchmarks/load.py.
HASH = Dims(n_embd=512, n_head=8, n_head_kv=4, head_dim=64, n_ff=11264, n_layer=1)
# The same with two layers (~70 MB f16), so a split over two nodes gives each some: fleetctl stage's test.
HASH2 = Dims(n_embd=512, n_head=8, n_head_kv=4, head_dim=64, n_ff=11264, n_layer=2)
# benchmarks/stage_lab.py's model: ~680 MB f16 (6 layers, 2 per node of a 3-node lab), every
# matrix but K and V above the 10 MiB hash threshold (Q and the attention output 2304 x 2304 in
# f16: 10.1 MiB; the FFN 6144 x 2304: 27 MiB), so ~94% of the bytes go by hash, as in a real
# model's f16 or Q8_0 weights.
STAGE = Dims(n_embd=2304, n_head=18, n_head_kv=6, head_dim=128, n_ff=6144, n_layer=6)
SIZES = {
    "tiny": TINY,
    "bench": BENCH,
    "mid": MID,
    "wide": WIDE,
    "wide12": WIDE12,
    "load": LOAD,
    "hash": HASH,
    "hash2": HASH2,
    "stage": STAGE,
}
# Random weights make chaotic models: rounding-level differences between two correct servers
# grow until a near-tie flips a greedy token. Small layer gains (the residual stream
# dominates) and wide logit and router margins keep the models decisive, as trained ones are.
LAYER_GAIN, DECISIVE = 0.5, 8.0
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "be",
    "are",
    "were",
    "this",
    "which",
    "or",
    "had",
    "not",
    "but",
    "have",
    "one",
    "all",
    "their",
    "they",
    "we",
    "there",
    "been",
    "has",
    "when",
    "who",
    "more",
    "its",
    "so",
    "some",
    "time",
    "would",
    "up",
    "out",
    "if",
    "about",
    "into",
    "than",
    "them",
    "only",
    "other",
    "new",
    "may",
    "these",
    "two",
    "first",
    "any",
    "then",
    "also",
]

FILE_TYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_k": (GGMLQuantizationType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
}


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types): control tokens, the 256 byte tokens, then letters and words
    scored by length so whole words win."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [TokenType.BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + w for w in WORDS]
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)
    # Longer pieces score higher, so the tokenizer prefers whole words.
    scores = [0.0] * (3 + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """f32 (rows, n) -> Q4_K bytes (rows, n/256*144): per 32-element sub-block a scale and a
    min (6 bits each, relative to the f16 super-block d and dmin), 4-bit values."""
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    mins = np.maximum(0, -blocks.min(axis=2))  # stored positive, subtracted
    scales = (blocks.max(axis=2) + mins) / 15
    d = (scales.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(scales / d32)), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.rint(mins / dmin32)), 0, 63).astype(np.uint8)
        step = (d32 * sc)[:, :, None]
        q = np.clip(np.nan_to_num(np.rint((blocks + (dmin32 * mn)[:, :, None]) / step)), 0, 15).astype(
            np.uint8
        )
    packed_scales = np.zeros((blocks.shape[0], 12), np.uint8)
    packed_scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed_scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed_scales[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    out = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales, qs], axis=1
    )
    return out.reshape(x.shape[0], -1) if x.ndim == 2 else out.reshape(x.shape[:-1] + (-1,))


def encode(values: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Weights in the file's type; 1-D tensors (norms) stay F32, as llama.cpp's converters do."""
    if values.ndim == 1 or qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32), GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16), qtype
    if qtype == GGMLQuantizationType.Q4_K and values.shape[-1] % 256 == 0:
        return quantize_q4_k(values), qtype
    return gguf_quants.quantize(
        values.astype(np.float32), GGMLQuantizationType.Q8_0
    ), GGMLQuantizationType.Q8_0


def weights(arch: str, n_vocab: int, rng: np.random.Generator, d: Dims) -> dict[str, np.ndarray]:
    """Tensors in numpy order (ggml ne reversed), scaled so logits keep clear margins."""

    def mat(rows, cols, scale=LAYER_GAIN):
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {
        "token_embd.weight": (rng.standard_normal((n_vocab, d.n_embd))).astype(np.float32),
        "output_norm.weight": norm(d.n_embd),
        "output.weight": mat(n_vocab, d.n_embd, DECISIVE),
    }
    for i in range(d.n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(d.n_embd)
        t[p + "attn_q.weight"] = mat(d.n_head * d.head_dim, d.n_embd)
        t[p + "attn_k.weight"] = mat(d.n_head_kv * d.head_dim, d.n_embd)
        t[p + "attn_v.weight"] = mat(d.n_head_kv * d.head_dim, d.n_embd)
        t[p + "attn_output.weight"] = mat(d.n_embd, d.n_head * d.head_dim)
        t[p + "ffn_norm.weight"] = norm(d.n_embd)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            t[p + "attn_q_norm.weight"] = norm(d.head_dim)
            t[p + "attn_k_norm.weight"] = norm(d.head_dim)
        if arch == "gemma3":
            t[p + "post_attention_norm.weight"] = norm(d.n_embd)
            t[p + "post_ffw_norm.weight"] = norm(d.n_embd)
        if arch == "qwen3moe":
            t[p + "ffn_gate_inp.weight"] = mat(d.n_expert, d.n_embd, DECISIVE)
            t[p + "ffn_gate_exps.weight"] = np.stack(
                [mat(d.n_ff_expert, d.n_embd) for _ in range(d.n_expert)]
            )
            t[p + "ffn_up_exps.weight"] = np.stack([mat(d.n_ff_expert, d.n_embd) for _ in range(d.n_expert)])
            t[p + "ffn_down_exps.weight"] = np.stack(
                [mat(d.n_embd, d.n_ff_expert) for _ in range(d.n_expert)]
            )
        else:
            t[p + "ffn_gate.weight"] = mat(d.n_ff, d.n_embd)
            t[p + "ffn_up.weight"] = mat(d.n_ff, d.n_embd)
            t[p + "ffn_down.weight"] = mat(d.n_embd, d.n_ff)
    if arch == "gemma3":
        # Gemma scales embeddings by sqrt(n_embd) in the graph. The output stays untied (the
        # loader accepts either): tied to weak layers, every token would predict itself.
        t["token_embd.weight"] *= 0.1
    return t


def write_model(path: Path, arch: str, type_name: str, d: Dims = TINY) -> None:
    """Write the GGUF at `path`: `arch`'s hyperparameters from `d`, the tokenizer, and weights
    seeded per family and stored as `type_name`."""
    qtype, file_type = FILE_TYPES[type_name]
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(sum(map(ord, arch)))  # per family, same for every weight type
    w = GGUFWriter(str(path), arch)
    w.add_name(f"fleetd-test-{arch}-{type_name}")
    w.add_file_type(file_type)
    w.add_context_length(d.n_ctx)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    w.add_head_count_kv(d.n_head_kv)
    w.add_key_length(d.head_dim)
    w.add_value_length(d.head_dim)
    w.add_rope_dimension_count(d.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3moe":
        w.add_expert_count(d.n_expert)
        w.add_expert_used_count(d.n_expert_used)
        w.add_expert_feed_forward_length(d.n_ff_expert)
    if arch == "gemma3":
        w.add_sliding_window(64)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    for name, values in weights(arch, len(tokens), rng, d).items():
        data, raw_type = encode(values, qtype)
        if raw_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


ARCHS = ("llama", "qwen3", "qwen3moe", "gemma3")


def generate_named(name: str, out_dir: Path) -> Path:
    """`generate` for a model named as its file is, "<arch>-<type>[-<size>]" (the benchmarks'
    --models names): "llama-q8_0", "llama-q4_k-bench"."""
    parts = name.split("-")
    size = parts.pop() if parts[-1] in SIZES else "tiny"
    if len(parts) != 2:
        raise ValueError(f"model {name!r}: expected <arch>-<type>[-<size>] of fleetd.models")
    return generate(parts[0], parts[1], out_dir, size)


def generate(arch: str, type_name: str, out_dir: Path, size: str = "tiny") -> Path:
    """Write `<out_dir>/<arch>-<type>[-<size>].gguf` (reused when already there); its path."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r} (known: {', '.join(ARCHS)})")
    if type_name not in FILE_TYPES:
        raise ValueError(f"unknown weight type {type_name!r} (known: {', '.join(FILE_TYPES)})")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (known: {', '.join(SIZES)})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if size == "tiny" else f"-{size}"
    path = out_dir / f"{arch}-{type_name}{suffix}.gguf"
    if not path.is_file():
        part = path.with_suffix(".part")
        write_model(part, arch, type_name, SIZES[size])
        part.replace(path)
    return path
