"""Build (once, cached outside the repo) a GGUF with Phi-4-mini-reasoning's exact shapes — phi3,
3072 wide, 32 layers, 24 heads, 8 KV heads, FFN 8192, vocab 200064, tied embeddings, partial
rotary 96 — with random weights, quantized to Q4_K_M by llama.cpp's own quantizer. Every timing on
it is the real model's cost per token on this machine.

    python bench/shaped_model.py            # prints the path; ~10 GB of disk while building
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.tinymodel import (  # noqa: E402
    SPECIAL_TOKENS,
    add_phi3_metadata,
    bytes_to_unicode,
    train_bpe,
)

CACHE = Path(os.environ.get("PHI4_BENCH_CACHE", Path.home() / ".cache" / "phi4-bench"))
TARGET = CACHE / "phi4-mini-shaped-Q4_K_M.gguf"
EMBED, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 3072, 32, 24, 8, 8192, 200064
HEAD_DIM = EMBED // HEADS
N_ROT = 96
LLAMA_FTYPE_MOSTLY_Q4_K_M = 15


def _vocab() -> tuple[list[str], list[gguf.TokenType], list[str]]:
    byte_tokens = list(bytes_to_unicode().values())
    merged, merges = train_bpe(400)
    tokens = byte_tokens + merged
    normal = len(tokens)
    tokens += SPECIAL_TOKENS
    # Padding as plain (unreachable) tokens: 200k control tokens would make llama.cpp try each
    # one against every prompt it tokenizes.
    tokens += [f"[pad{i}]" for i in range(VOCAB - len(tokens))]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for i in range(normal, normal + len(SPECIAL_TOKENS)):
        types[i] = gguf.TokenType.CONTROL
    return tokens, types, merges


def write_f16(path: Path) -> None:
    rng = np.random.default_rng(0)
    # One pool of random values, scaled once, sliced for every tensor: writing 3.8 B fresh
    # random numbers would take minutes and change nothing about the cost per token.
    pool = rng.standard_normal(1 << 24).astype(np.float16)
    layer_pool = (pool * np.float16(1 / np.sqrt(EMBED))).astype(np.float16)
    embed_pool = (pool * np.float16(0.02)).astype(np.float16)

    def tensor(source: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return np.resize(source, int(np.prod(shape))).reshape(shape)

    tokens, types, merges = _vocab()
    writer = gguf.GGUFWriter(str(path), "phi3")
    add_phi3_metadata(
        writer,
        name="phi4-mini-shaped-bench",
        embed=EMBED,
        layers=LAYERS,
        heads=HEADS,
        kv_heads=KV_HEADS,
        ffn=FFN,
        n_rot=N_ROT,
        file_type=gguf.LlamaFileType.MOSTLY_F16,
        tokens=tokens,
        types=types,
        merges=merges,
    )
    ones = np.ones(EMBED, dtype=np.float32)
    writer.add_tensor("token_embd.weight", tensor(embed_pool, (VOCAB, EMBED)))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("rope_factors_long.weight", np.ones(N_ROT // 2, dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.ones(N_ROT // 2, dtype=np.float32))
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        qkv_rows = EMBED + 2 * KV_HEADS * HEAD_DIM
        writer.add_tensor(f"blk.{i}.attn_qkv.weight", tensor(layer_pool, (qkv_rows, EMBED)))
        writer.add_tensor(f"blk.{i}.attn_output.weight", tensor(layer_pool, (EMBED, EMBED)))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", tensor(layer_pool, (2 * FFN, EMBED)))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", tensor(layer_pool, (EMBED, FFN)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build() -> Path:
    if TARGET.is_file():
        return TARGET
    import llama_cpp

    CACHE.mkdir(parents=True, exist_ok=True)
    f16 = CACHE / "phi4-mini-shaped-F16.gguf"
    partial = TARGET.with_suffix(".part")
    started = time.monotonic()
    write_f16(f16)
    print(f"wrote {f16} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = os.cpu_count() or 2
    started = time.monotonic()
    code = llama_cpp.llama_model_quantize(str(f16).encode(), str(partial).encode(), params)
    f16.unlink()
    if code != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama_model_quantize failed ({code})")
    partial.rename(TARGET)
    print(f"quantized to {TARGET} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return TARGET


if __name__ == "__main__":
    print(build())
