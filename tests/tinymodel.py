"""Write a tiny synthetic GGUF of llama.cpp architecture ``phi3`` with Phi-4-mini's chat format.

Random weights, a small byte-level BPE vocabulary trained here on a few sentences, and
Phi-4-mini-reasoning's special tokens and chat template. It exercises the exact architecture,
tokenizer pre-type (``gpt-4o``) and template path of the real model in milliseconds.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# Structurally the template Phi-4-mini-reasoning ships: the identity sentence is always there,
# a system message is appended to it, then each turn as <|role|>content<|end|>.
PHI4_MINI_REASONING_TEMPLATE = (
    "{{ '<|system|>Your name is Phi, an AI math expert developed by Microsoft.' }}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ ' ' + message['content'] }}{% endif %}{% endfor %}{{ '<|end|>' }}"
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

_CORPUS = (
    "Your name is Phi, an AI math expert developed by Microsoft. "
    "What is 12*13? Solve 3x^2+4x+5=1. The answer is 156. Let me think step by step. "
    "the quadratic formula gives x = -b over 2a. Therefore the final answer is boxed. "
    "What is 2+2? It is 4. Compute the sum of the numbers from one to ten."
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes, strict=True)}


def train_bpe(n_merges: int, corpus: str = _CORPUS) -> tuple[list[str], list[str]]:
    """Return (merged token strings, merges) learned greedily on the corpus."""
    table = bytes_to_unicode()
    words = Counter(
        tuple(table[b] for b in (" " + word if i else word).encode())
        for i, word in enumerate(corpus.split(" "))
    )
    merges: list[str] = []
    merged_tokens: list[str] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for a, b in itertools.pairwise(word):
                pairs[(a, b)] += count
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        merges.append(f"{a} {b}")
        merged_tokens.append(a + b)
        new_words: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_words[tuple(out)] += count
        words = new_words
    return merged_tokens, merges


def add_phi3_metadata(
    writer: gguf.GGUFWriter,
    *,
    name: str,
    embed: int,
    layers: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    n_rot: int,
    file_type: gguf.LlamaFileType,
    tokens: list[str],
    types: list[gguf.TokenType],
    merges: list[str],
) -> None:
    """Write Phi-4-mini's hyperparameters (for the given shapes), tokenizer and chat template."""
    eot = tokens.index("<|endoftext|>")
    writer.add_name(name)
    writer.add_context_length(131072)
    writer.add_rope_scaling_orig_ctx_len(4096)
    writer.add_embedding_length(embed)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_rot)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(file_type)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    writer.add_chat_template(PHI4_MINI_REASONING_TEMPLATE)


def write_tiny_phi3(
    path: Path,
    *,
    embed: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab_size: int = 512,
    seed: int = 0,
    name: str = "tiny-test-model",
    successors: dict[int, int] | None = None,
    corpus: str = _CORPUS,
    pieces: list[str] | None = None,
) -> Path:
    """Write the model to ``path`` and return it. Deterministic for a given seed.

    With ``successors`` (token -> the token to follow it), a scripted model: its layers add
    nothing, so the logits depend on the last token alone, and its output matrix makes each
    given token's successor the likeliest by far (greedy decoding follows the script).
    ``pieces``: texts made tokens of their own after the learned ones (the tokenizer never makes
    them; a script may write them), the vocabulary growing by as many."""
    rng = np.random.default_rng(seed)
    byte_tokens = list(bytes_to_unicode().values())
    merged, merges = train_bpe(vocab_size - len(byte_tokens) - len(SPECIAL_TOKENS), corpus)
    tokens = byte_tokens + merged
    n_normal = len(tokens)
    tokens += SPECIAL_TOKENS
    tokens += [f"<|dummy_{i}|>" for i in range(vocab_size - len(tokens))]
    types = [gguf.TokenType.NORMAL] * n_normal + [gguf.TokenType.CONTROL] * (len(tokens) - n_normal)
    if pieces:  # after all the others: no other token's id moves
        to_unicode = bytes_to_unicode()
        extra = ["".join(to_unicode[b] for b in piece.encode()) for piece in pieces]
        assert not set(extra) & set(tokens) and len(set(extra)) == len(extra)
        tokens += extra
        types += [gguf.TokenType.NORMAL] * len(extra)
        vocab_size += len(extra)
    head_dim = embed // heads
    n_rot = head_dim * 3 // 4  # partial rotary, as in Phi-4-mini (96 of 128)

    writer = gguf.GGUFWriter(str(path), "phi3")
    # The name must not contain "phi3": llama.cpp then looks up a "</s>" token this vocab lacks.
    # One with "reasoning" in it is taken for a model that thinks first, like Phi-4-mini-reasoning.
    add_phi3_metadata(
        writer,
        name=name,
        embed=embed,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        n_rot=n_rot,
        file_type=gguf.LlamaFileType.ALL_F32,
        tokens=tokens,
        types=types,
        merges=merges,
    )

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    embeddings = normal((vocab_size, embed), 0.02)
    # Control, padding and non-printable-byte rows small, so decoding prefers printable text.
    embeddings[n_normal:] *= 0.01
    to_byte = {char: byte for byte, char in bytes_to_unicode().items()}
    for index, token in enumerate(tokens[:n_normal]):
        if any(not 0x20 <= to_byte[char] <= 0x7E for char in token):
            embeddings[index] *= 0.01
    if successors is not None:
        embeddings = normal((vocab_size, embed), 1.0)
        embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
        output = np.zeros((vocab_size, embed), dtype=np.float32)
        for token, following in successors.items():
            output[following] += 3.0 * embeddings[token]  # (the norm scales it by sqrt(embed))
    writer.add_tensor("token_embd.weight", embeddings)
    if successors is not None:
        writer.add_tensor("output.weight", output)
    writer.add_tensor("output_norm.weight", np.ones(embed, dtype=np.float32))
    writer.add_tensor("rope_factors_long.weight", np.ones(n_rot // 2, dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.ones(n_rot // 2, dtype=np.float32))
    layer_std = 1.0 / np.sqrt(embed)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(embed, dtype=np.float32))
        writer.add_tensor(
            f"blk.{i}.attn_qkv.weight", normal((embed + 2 * kv_heads * head_dim, embed), layer_std)
        )
        quiet = 0.0 if successors is not None else 1.0  # a scripted model's layers add nothing
        writer.add_tensor(f"blk.{i}.attn_output.weight", normal((embed, embed), layer_std) * quiet)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(embed, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", normal((2 * ffn, embed), layer_std))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", normal((embed, ffn), layer_std) * quiet)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_script_model(path: Path, thinking: str, answer: str, *, loops: bool = False) -> Path:
    """A scripted reasoning model (see ``successors``): greedy, it writes ``thinking``, then
    `` </think>``, then ``answer``, and stops; with ``loops``, it writes ``thinking`` again and
    again, and answers only once something ends the thinking for it (a line break). After
    " Wait" (--min-think) it thinks from the start again. Each piece should start with a space
    (the vocabulary is learned on the script's words, space first), and no token may appear
    twice in the script with different successors: ValueError."""
    import llama_cpp

    close = " </think>"
    # The script's words, " Wait" and the tag are the vocabulary's: few tokens, each its own.
    corpus = " ".join(["x"] + [thinking, close, answer, " Wait"] * 4)
    plain = write_tiny_phi3(path, name="tiny-reasoning-script", corpus=corpus)
    vocab = llama_cpp.Llama(str(plain), vocab_only=True, verbose=False)

    def tokens(text: str) -> list[int]:
        return vocab.tokenize(text.encode(), add_bos=False, special=True)

    think, said = tokens(thinking), tokens(answer)
    start = tokens("<|assistant|>")
    pairs = list(itertools.pairwise([*start, *think, *(think[:1] if loops else tokens(close))]))
    pairs += list(itertools.pairwise([*said, *tokens("<|endoftext|>")]))
    pairs += [(tokens(" Wait")[-1], think[0]), (tokens("\n")[-1], said[0])]
    if not loops:  # (the daemon's own "\n</think>\n\n" ends in a line break)
        pairs.append((tokens(close)[-1], said[0]))
    successors: dict[int, int] = {}
    for token, following in pairs:
        if successors.setdefault(token, following) != following:
            raise ValueError(f"token {vocab.detokenize([token])!r} repeats in the script")
    vocab.close()
    return write_tiny_phi3(path, name="tiny-reasoning-script", successors=successors, corpus=corpus)


def unique_pieces(text: str, taken: set[str]) -> list[str]:
    """``text`` cut at word starts into pieces none of which is in ``taken`` or twice in the
    list: each the fewest words (with the space before them) not used yet."""
    starts = [0] + [
        i for i in range(1, len(text)) if text[i - 1].isspace() and not text[i].isspace()
    ]
    starts.append(len(text))
    pieces: list[str] = []
    used = set(taken)
    at = 0
    while at < len(starts) - 1:
        end = at + 1
        while end < len(starts) - 1 and text[starts[at] : starts[end]] in used:
            end += 1
        piece = text[starts[at] : starts[end]]
        if piece in used:  # the text's last words were used before: join them to the one before
            pieces[-1] += piece
        else:
            pieces.append(piece)
        used.add(pieces[-1])
        at = end
    assert "".join(pieces) == text and len(set(pieces)) == len(pieces)
    return pieces


def write_text_script_model(
    path: Path,
    thinking: str,
    answer: str,
    *,
    loop_from: int | None = None,
    name: str = "tiny-reasoning-script",
) -> Path:
    """A scripted reasoning model for any ``thinking`` text, however often its words recur:
    the text is cut into pieces each made a token of its own (``unique_pieces``), so that each
    has one successor. Greedy, it writes ``thinking``, `` </think>`` and ``answer``, and stops;
    with ``loop_from`` (a character offset), it writes ``thinking[loop_from:]`` again and again
    after the first time, answering once something ends the thinking for it (a line break).
    A ``name`` that does not say it reasons (nor the path's) makes a model that closes a
    thinking it never opened."""
    import llama_cpp

    close = " </think>"
    corpus = " ".join(["x"] + [close, answer] * 4)
    plain = write_tiny_phi3(path, name=name, corpus=corpus)
    vocab = llama_cpp.Llama(str(plain), vocab_only=True, verbose=False)

    def tokens(text: str) -> list[int]:
        return vocab.tokenize(text.encode(), add_bos=False, special=True)

    learned = {vocab.detokenize([t]).decode("utf-8", "replace") for t in range(vocab.n_vocab())}
    head = unique_pieces(thinking[:loop_from], learned) if loop_from is not None else []
    pieces = head + unique_pieces(thinking[len("".join(head)) :], learned | set(head))
    first = vocab.n_vocab()  # the pieces' tokens come after all the others
    think = list(range(first, first + len(pieces)))
    said, start = tokens(answer), tokens("<|assistant|>")
    loops_to = think[len(head)] if loop_from is not None else None
    chain = [*start, *think, *([loops_to] if loops_to is not None else tokens(close))]
    pairs = list(itertools.pairwise(chain))
    pairs += list(itertools.pairwise([*said, *tokens("<|endoftext|>")]))
    pairs.append((tokens("\n")[-1], said[0]))
    if loops_to is None:
        pairs.append((tokens(close)[-1], said[0]))
    vocab.close()
    successors: dict[int, int] = {}
    for token, following in pairs:
        if successors.setdefault(token, following) != following:
            raise ValueError(f"token {token} repeats in the script")
    return write_tiny_phi3(
        path, name=name, successors=successors, corpus=corpus, pieces=pieces, embed=128
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Write the tests' tiny synthetic phi3 GGUF.")
    parser.add_argument(
        "path",
        nargs="?",
        default="tiny-phi3.gguf",
        help="where to write it (default: ./tiny-phi3.gguf)",
    )
    print(write_tiny_phi3(Path(parser.parse_args().path)))
