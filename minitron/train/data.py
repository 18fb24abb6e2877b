"""Text to batches: a byte-level tokenizer, a memory-mapped token file, a resumable loader.

    tokens = prepare("data/corpus.txt", "runs/corpus.bin")   # bytes -> uint8 token file (cached)
    train, val = split(tokens, held_out=0.1)                 # the last 10% is never trained on
    loader = Loader(train, batch=16, seq=64, seed=0)
    tokens, targets = loader.batch(step)                      # the global batch of that step

Byte-level: token = one byte of the UTF-8 text (vocabulary 256), so any text works and nothing
is learned or downloaded. The token file is read through np.memmap: a corpus larger than
memory costs only the pages a batch touches.

The loader is a pure function of (seed, step): batch(step) draws its rows' start offsets from a
generator seeded by both. Every rank computes the same global batch and keeps its own rows
(train.step.replica_rows: micro-batch m of the step is the same rows on any layout, each
replica holding one slice of it, as Megatron's sampler deals them), so data-parallel ranks
see different sequences; and resuming at step s is just calling batch(s): the data position a
checkpoint stores is the step.
"""
from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import torch

VOCAB_SIZE = 256


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def escaped(tokens) -> str:
    """The tokens as one line a terminal shows as it is, whatever bytes a model emits: valid
    UTF-8 that prints stays (accented letters too); newline, tab and carriage return become
    "\\n", "\\t", "\\r", the backslash "\\\\", and every other byte of a character that does not
    print (ESC, U+200B) or of no character (invalid UTF-8) "\\xNN": the bytes can be read back
    exactly (codecs.escape_decode), and none moves the cursor or becomes a replacement character."""
    text = bytes(int(t) for t in tokens).decode("utf-8", errors="surrogateescape")
    return "".join(_escape(c) for c in text)


_SHORT = {"\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    if c.isprintable():                     # a lone surrogate (an undecodable byte) is not
        return c
    raw = c.encode("utf-8", errors="surrogateescape")   # back to the byte(s) it came from
    return "".join(f"\\x{b:02x}" for b in raw)


def prepare(text_path: str, token_path: str, seq: int | None = None) -> np.memmap:
    """Write `text_path`'s bytes as a token file (unless it already holds exactly them); map it.

    The token file is a cache keyed by its source: `token_path`.source.json records the text's
    path, size and sha256, and the file is reused only when all three match (a date says
    nothing: a copied or restored text can be older than a stale cache). Both are written to a
    temporary name and renamed, the key last and removed first, so a run killed midway leaves
    no key, and the next run rebuilds. With `seq`, a text too short to give each split one
    sequence (and its next-token targets) is refused, naming the file, before anything is written.
    """
    if not os.path.isfile(text_path):
        raise ValueError(f"corpus {text_path} does not exist: pass --corpus PATH to a text file")
    size = os.path.getsize(text_path)
    check_long_enough(text_path, size, seq)
    key = {"source": os.path.abspath(text_path), "bytes": size, "sha256": sha256_file(text_path)}
    key_path = token_path + ".source.json"
    if not (_read_key(key_path) == key and os.path.isfile(token_path)
            and os.path.getsize(token_path) == size):
        if os.path.exists(key_path):
            os.remove(key_path)
        with open(text_path, "rb") as f:
            data = f.read()
        key.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())  # what was written
        _write_atomically(token_path, data)          # other ranks never see half a file
        _write_atomically(key_path, json.dumps(key).encode())
    return np.memmap(token_path, dtype=np.uint8, mode="r")


def check_long_enough(text_path: str, n_tokens: int, seq: int | None, held_out: float = 0.1) -> None:
    """ValueError naming the file unless both splits hold one sequence and its targets."""
    if n_tokens == 0:
        raise ValueError(f"corpus {text_path} is empty: pass --corpus PATH to a text file")
    if seq is None:
        return
    train, val = (len(part) for part in split(range(n_tokens), held_out))
    if min(train, val) >= seq + 2:
        return
    need = next(n for n in range(n_tokens, 100 * (seq + 2))
                if min(len(part) for part in split(range(n), held_out)) >= seq + 2)
    shorter = f" or --seq {min(train, val) - 2}" if min(train, val) > 2 else ""
    raise ValueError(f"corpus {text_path} has {n_tokens} bytes: the training text ({train}) and "
                     f"the held-out text ({val}) each need one sequence of --seq {seq} and its "
                     f"next-token targets ({seq + 2} bytes); use a corpus of at least {need} "
                     f"bytes{shorter}")


def sha256_file(path: str) -> str:
    """The file's SHA-256, read a MiB at a time (the corpus cache's key, checkpoints' checksums)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_key(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_atomically(path: str, payload: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, path)


def split(tokens: np.ndarray, held_out: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation): the last `held_out` share of the tokens is kept for evaluation."""
    cut = int(len(tokens) * (1 - held_out))
    return tokens[:cut], tokens[cut:]


class Loader:
    """batch(step) -> (tokens [batch, seq], next-token targets [batch, seq]), int64."""

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0):
        if len(tokens) < seq + 2:
            raise ValueError(f"the text has {len(tokens)} tokens, too few for sequences of {seq}: "
                             "use a longer corpus or a shorter --seq")
        self.tokens, self.batch_size, self.seq, self.seed = tokens, batch, seq, seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq - 1, (self.batch_size,), generator=gen)
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq + 1]) for s in starts.tolist()])
        data = torch.from_numpy(rows.astype(np.int64))
        return data[:, :-1], data[:, 1:]


# ---- the shipped corpus: generated, so it is certainly free (data/README.md) ------------------
_WORDS = {
    "name": "Ada Ben Cleo Dan Eva Finn Gus Hana Ivo Jun Kit Lena Milo Nora Otto Pia".split(),
    "animal": "fox owl cat hare crow mole goat wren frog bee".split(),
    "adj": "small old red quiet bright green slow tall warm tired clever brave".split(),
    "thing": "lamp boat map key bell coat kite drum cup book stone rope".split(),
    "place": "the mill|the river|the hill|the market|the forest|the bridge|the harbour|the school".split("|"),
    "verb": "found|carried|painted|lost|mended|sold|hid|opened|counted|borrowed".split("|"),
    "time": "at dawn|in the evening|after the rain|on Monday|before supper|at noon|in winter".split("|"),
}
_TEMPLATES = [
    "{name} {verb} the {adj} {thing} near {place} {time}.",
    "The {adj} {animal} watched {name} from {place}.",
    "{time}, {name} and {name2} walked to {place} with a {thing}.",
    "\"Where is my {thing}?\" asked {name}. \"By {place},\" said {name2}.",
    "A {adj} {animal} {verb} a {thing} {time}, and nobody saw it.",
    "{name} counted {n} {animal}s on the way to {place}.",
    "Every {thing} in {place} was {adj}, so {name} {verb} one {time}.",
]


def make_corpus(n_sentences: int = 6000, seed: int = 0) -> str:
    """A deterministic text of simple sentences from the word lists above (written for minitron,
    dedicated to the public domain): regular enough that a tiny model's loss falls in minutes."""
    rng = random.Random(seed)
    lines, para = [], []
    for _ in range(n_sentences):
        words = {k: rng.choice(v) for k, v in _WORDS.items()}
        words["name2"] = rng.choice(_WORDS["name"])
        words["n"] = rng.choice("two three four five six seven".split())
        sentence = rng.choice(_TEMPLATES).format(**words)
        para.append(sentence[0].upper() + sentence[1:])
        if len(para) >= rng.randint(3, 6):
            lines.append(" ".join(para))
            para = []
    return "\n\n".join(lines) + "\n"
