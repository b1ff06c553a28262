"""The chat tokenizer: a tiktoken BPE plus nanochat's chat special tokens.

On disk a tokenizer is two files in the checkpoint directory: `tokenizer.tiktoken` (tiktoken's
own format, one `base64(token) rank` per line) and `tokenizer_config.json` (the split pattern and
the special tokens by name and id). Nothing is pickled and nothing is downloaded.
"""
from __future__ import annotations

import base64
import codecs
import os

import tiktoken

from .config import CheckpointError, read_json, write_json

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)

# GPT-4's split pattern with numbers grouped by up to two digits, as nanochat trains its tokenizer.
DEFAULT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)


def read_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken ranks file: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


class ChatTokenizer:
    """Encode/decode text and look up the chat special tokens by name."""

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int],
                 name: str = "chat"):
        missing = [s for s in SPECIAL_TOKENS if s not in special_tokens]
        if missing:
            raise CheckpointError(f"tokenizer lacks the chat special tokens {missing}")
        self.enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                     special_tokens=special_tokens)
        self.pattern = pattern
        self.special_tokens = dict(special_tokens)
        self._special_ids = frozenset(special_tokens.values())

    # ---- construction and storage
    @classmethod
    def from_ranks(cls, mergeable_ranks: dict[bytes, int], pattern: str = DEFAULT_PATTERN,
                   extra_special: tuple[str, ...] = ()) -> "ChatTokenizer":
        """Append the chat special tokens (and any extra ones) after the ordinary vocabulary."""
        start = max(mergeable_ranks.values()) + 1
        names = [s for s in SPECIAL_TOKENS + tuple(extra_special)]
        return cls(mergeable_ranks, pattern, {s: start + i for i, s in enumerate(names)})

    @classmethod
    def from_encoding(cls, enc: tiktoken.Encoding) -> "ChatTokenizer":
        return cls(enc._mergeable_ranks, enc._pat_str, enc._special_tokens, name=enc.name)

    @classmethod
    def from_dir(cls, path: str) -> "ChatTokenizer":
        bpe_path = os.path.join(path, "tokenizer.tiktoken")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        for p in (bpe_path, cfg_path):
            if not os.path.isfile(p):
                raise CheckpointError(f"{p}: missing tokenizer file")
        cfg = read_json(cfg_path)
        return cls(read_ranks(bpe_path), cfg["pattern"], cfg["special_tokens"], name=cfg.get("name", "chat"))

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        with open(os.path.join(path, "tokenizer.tiktoken"), "wb") as f:
            for token, rank in ranks:
                f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        write_json(os.path.join(path, "tokenizer_config.json"),
                   {"name": self.enc.name, "pattern": self.pattern, "special_tokens": self.special_tokens})

    # ---- use
    @property
    def vocab_size(self) -> int:
        return self.enc.n_vocab

    @property
    def bos_id(self) -> int:
        return self.special_tokens["<|bos|>"]

    def encode_special(self, name: str) -> int:
        try:
            return self.special_tokens[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def encode(self, text: str) -> list[int]:
        """Ordinary text to ids; special-token text in user input is encoded as plain text, never as a control token."""
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(list(ids), errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of an ordinary token; special tokens have none (they are structure, not text)."""
        if token_id in self._special_ids:
            return b""
        return self.enc.decode_single_token_bytes(token_id)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


def train_tokenizer(texts, vocab_size: int, pattern: str | None = None) -> ChatTokenizer:
    """Train a byte-level BPE with rustbpe (a test/training dependency) and add the chat special tokens; `pattern`:
    the split pattern (default rustbpe's own, GPT-4's)."""
    import rustbpe

    bpe = rustbpe.Tokenizer()
    bpe.train_from_iterator(iter(texts), vocab_size - len(SPECIAL_TOKENS), **({"pattern": pattern} if pattern else {}))
    ranks = {bytes(tok): rank for tok, rank in bpe.get_mergeable_ranks()}
    return ChatTokenizer.from_ranks(ranks, bpe.get_pattern())


class StreamDecoder:
    """Turns a token stream into text deltas without ever emitting half a UTF-8 character.

    Bytes of an incomplete character are held until the character completes; an invalid byte
    sequence becomes U+FFFD instead of silently swallowing the rest of the stream. `flush()` returns
    what is left at the end of the stream; an incomplete tail is dropped.
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        pending, _ = self._utf8.getstate()
        self._utf8.reset()
        return pending.decode("utf-8", errors="ignore")
