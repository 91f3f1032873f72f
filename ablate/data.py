"""Token sources: `synthetic` (a seeded Markov chain), `tokens` (nanoGPT .bin files), `chars` (text).

Each option's `load(seq_len, model_vocab)` returns a TokenData: deterministic (B, T) batches for any step and
rank, and a fixed held-out split for eval_loss. Loading waits for the worker; what makes a point invalid
is found in the job, before any worker starts: values by the constructor, files by `check()` (a cheap
look: sizes, the head of a text), so a plan (predict_only=true) refuses the points a run would.
"""
from __future__ import annotations

import abc
import codecs
import math
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ablate.techniques import Invalid

Batch = tuple[torch.Tensor, torch.Tensor]  # inputs, targets: (B, T) int64 each


class TokenData(abc.ABC):
    """Base: subclasses give `_train_rows(idx)` and the eval rows, each row seq_len + 1 tokens."""

    vocab_size: int
    loss_floor: float | None = None  # best achievable mean cross-entropy (nats), when known

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Samples [(step * world_size + rank) * B, ... + B) of the training order."""
        first = (step * world_size + rank) * batch_size
        return _split(self._train_rows(np.arange(first, first + batch_size)))

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        rows = self._eval_rows()
        for i in range(0, len(rows), batch_size):
            yield _split(rows[i : i + batch_size])

    @abc.abstractmethod
    def _train_rows(self, idx: np.ndarray) -> np.ndarray:
        """Training samples number `idx` (any count, wrapping into later epochs): (len(idx), T + 1)."""

    @abc.abstractmethod
    def _eval_rows(self) -> np.ndarray:
        """The whole held-out split: (eval_samples, T + 1)."""


def _split(rows: np.ndarray) -> Batch:
    t = torch.from_numpy(rows.astype(np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class _Table(TokenData):
    """A fixed set of sample rows, shuffled afresh (and deterministically) every epoch."""

    def __init__(self, train: np.ndarray, eval_rows: np.ndarray, vocab_size: int, seed: int):
        self.train, self.eval, self.vocab_size, self.seed = train, eval_rows, vocab_size, seed
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng((self.seed, epoch)).permutation(len(self.train))
        return self._orders[epoch]

    def _train_rows(self, idx: np.ndarray) -> np.ndarray:
        n = len(self.train)
        return np.stack([self.train[self._order(int(i) // n)[int(i) % n]] for i in idx])

    def _eval_rows(self) -> np.ndarray:
        return self.eval


class _Stream(TokenData):
    """Two long 1-D token arrays; a sample is a window at a seeded random offset (nanoGPT style)."""

    def __init__(self, train: np.ndarray, val: np.ndarray, vocab_size: int, seq_len: int,
                 eval_samples: int, seed: int):
        for name, arr in (("train", train), ("val", val)):
            if len(arr) <= seq_len:
                # an error row, not invalid: a longer file at the same path fixes it, and a rerun retries errors
                raise ValueError(f"data.path: the {name} split has {len(arr)} tokens, "
                                 f"needs more than seq_len={seq_len}")
        self.train, self.val, self.vocab_size, self.T, self.seed = train, val, vocab_size, seq_len, seed
        starts = np.random.default_rng((seed, 1, 0)).integers(0, len(val) - seq_len, eval_samples)
        self._eval = self._windows(val, starts)

    def _windows(self, arr: np.ndarray, starts: np.ndarray) -> np.ndarray:
        rows = [np.asarray(arr[s : s + self.T + 1], dtype=np.int64) for s in starts]
        return np.stack(rows) if rows else np.empty((0, self.T + 1), dtype=np.int64)  # eval_samples=0

    def _train_rows(self, idx: np.ndarray) -> np.ndarray:
        starts = np.array([np.random.default_rng((self.seed, 0, int(i))).integers(0, len(self.train) - self.T)
                           for i in idx])
        return self._windows(self.train, starts)

    def _eval_rows(self) -> np.ndarray:
        return self._eval


class Synthetic:
    """An order-k Markov chain over `vocab_size` tokens with learnable structure.

    The previous `order` tokens hash to one of `vocab_size` contexts; each context allows
    `branching` distinct next tokens with Dirichlet(0.5) probabilities. A model that learns the
    chain reaches `loss_floor`: the exact mean entropy of the targets given everything before them.
    """

    def __init__(self, vocab_size: int | None = 512, order: int = 1, branching: int = 8,
                 train_samples: int = 10240, eval_samples: int = 256, seed: int = 1234):
        # else a ZeroDivisionError or numpy's "negative dimensions" in the worker, naming no key;
        # order=0 would be a unigram source, but loss_floor's count of start tokens assumes order >= 1
        for key, value in (("order", order), ("branching", branching), ("train_samples", train_samples)):
            if value < 1:
                raise Invalid(f"data.{key}={value} must be >= 1")
        _check_eval_samples(eval_samples)
        if vocab_size is not None and branching > vocab_size:
            raise Invalid(f"data.branching={branching} > data.vocab_size={vocab_size}")
        self.vocab_size, self.order, self.branching = vocab_size, order, branching
        self.train_samples, self.eval_samples, self.seed = train_samples, eval_samples, seed

    def load(self, seq_len: int, model_vocab: int | None = None) -> TokenData:
        """vocab_size=None draws from the whole of the model's vocabulary (`model_vocab`)."""
        rng = np.random.default_rng(self.seed)
        V, k = self.vocab_size or model_vocab, self.branching
        if V is None or k > V:
            raise Invalid(f"data.branching={k} > the {V} tokens data.vocab_size=null takes from the model")
        # Context s allows tokens (a_s + j * c_s) mod V, j < k: distinct because j * c_s < V.
        a = rng.integers(0, V, V)
        c = rng.integers(1, max(2, V // k), V)
        self._support = (a[:, None] + np.arange(k)[None, :] * c[:, None]) % V  # (V, k)
        probs = rng.dirichlet(np.full(k, 0.5), size=V)  # (V, k)
        self._cdf = np.cumsum(probs, axis=1)
        self._entropy = -(probs * np.log(np.maximum(probs, 1e-30))).sum(1)  # (V,) nats
        self._mult = rng.integers(1, 2**31 - 1, self.order) | 1  # context hash multipliers
        train, h_train = self._sample(rng, V, self.train_samples, seq_len)
        held_out, h_eval = self._sample(rng, V, self.eval_samples, seq_len)
        data = _Table(train, held_out, V, self.seed)
        data.loss_floor = h_eval if self.eval_samples else None  # no held-out targets, no floor for eval_loss
        return data

    def check(self) -> None:
        """No files to look at: the constructor checked every value."""

    def _sample(self, rng: np.random.Generator, V: int, n: int, seq_len: int) -> tuple[np.ndarray, float]:
        """n rows of seq_len + 1 tokens of a V-token vocabulary, and the mean target entropy (nats)."""
        K = self.order
        rows = np.empty((n, seq_len + 1), dtype=np.int32)
        rows[:, :K] = rng.integers(0, V, (n, min(K, seq_len + 1)))  # uniform start tokens
        entropy = (min(K, seq_len + 1) - 1) * math.log(V) * n  # targets among the start tokens
        for t in range(K, seq_len + 1):
            ctx = np.zeros(n, dtype=np.int64)
            for j in range(K):
                ctx += rows[:, t - 1 - j].astype(np.int64) * int(self._mult[j])
            ctx %= V
            pick = (rng.random(n)[:, None] > self._cdf[ctx]).sum(1).clip(max=self.branching - 1)
            rows[:, t] = self._support[ctx, pick]
            entropy += self._entropy[ctx].sum()
        return rows, float(entropy / (n * seq_len)) if n else math.nan


class Tokens:
    """nanoGPT-style data: `path`/train.bin and `path`/val.bin of uint16 token ids (np.memmap)."""

    def __init__(self, path: str, vocab_size: int = 50257, eval_samples: int = 256, seed: int = 1234):
        _check_eval_samples(eval_samples)
        self.path, self.vocab_size, self.eval_samples, self.seed = Path(path), vocab_size, eval_samples, seed

    def check(self) -> None:
        """Each file is there and holds whole uint16 tokens, at least one: its size alone, cheap
        enough for the job (an invalid row is checked again on a rerun: a file that appears runs)."""
        for name in ("train", "val"):
            f = self.path / f"{name}.bin"
            if not f.is_file():  # else np.memmap's FileNotFoundError in the worker, which a plan would not see
                raise Invalid(f"data.path={self.path}: no {f.name} there (nanoGPT's train.bin and val.bin of "
                              "uint16 tokens)")
            size = f.stat().st_size
            if size == 0:  # else np.memmap's "cannot mmap an empty file"
                raise Invalid(f"data.path={self.path}: {f.name} is empty (0 bytes): no tokens")
            if size and size % 2:  # else np.memmap's "not a multiple of the data-type size"
                raise Invalid(f"data.path={self.path}: {f.name} has an odd length of {size} bytes: "
                              "not uint16 tokens (2 bytes each)")

    def load(self, seq_len: int, model_vocab: int | None = None) -> TokenData:
        """Checks every token id against data.vocab_size and the model's vocabulary (one pass over
        the files: an id the model cannot embed would fail mid-run as an index error)."""
        self.check()  # again in the worker: the files may have changed since the job looked
        split = {}
        for name in ("train", "val"):
            f = self.path / f"{name}.bin"
            if not f.exists():
                raise FileNotFoundError(f"data.path={self.path}: missing {f.name}")
            split[name] = np.memmap(f, dtype=np.uint16, mode="r")
            top = int(split[name].max()) if len(split[name]) else -1
            for limit, what in ((self.vocab_size, "data.vocab_size"), (model_vocab, "the model's vocabulary")):
                if limit is not None and top >= limit:
                    raise Invalid(f"data.path={self.path}: {f.name} holds token id {top}, outside {what} "
                                  f"of {limit} tokens")
        return _Stream(split["train"], split["val"], self.vocab_size, seq_len, self.eval_samples, self.seed)


class Chars:
    """Character-level text: the vocabulary is the file's sorted characters; the last 10% is held out."""

    def __init__(self, path: str, eval_samples: int = 256, seed: int = 1234):
        _check_eval_samples(eval_samples)
        self.path, self.eval_samples, self.seed = Path(path), eval_samples, seed

    def check(self) -> None:
        """The file is there and its head is UTF-8 text, not empty: a small read, cheap enough for
        the job (a binary file shows in its first bytes)."""
        if not self.path.is_file():  # an invalid row, as a run's would be: a plan must refuse it too
            raise Invalid(f"data.path={self.path}: no such file (a UTF-8 text file)")
        with self.path.open("rb") as f:
            head = f.read(_TEXT_HEAD)
        problem = _not_text(head, whole=len(head) < _TEXT_HEAD)
        if problem:
            raise Invalid(f"data.path={self.path} {problem}")

    def load(self, seq_len: int, model_vocab: int | None = None) -> TokenData:
        self.check()  # again in the worker: the file may have changed since the job looked
        try:
            text = self.path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:  # past the head that check() read
            raise Invalid(f"data.path={self.path} is not UTF-8 text: {exc.reason}") from None
        except OSError as exc:  # named by its key, as Tokens names its missing files
            raise type(exc)(f"data.path={self.path}: {exc.strerror or exc}") from None
        if "\0" in text:  # past the head that check() read
            raise Invalid(f"data.path={self.path} is not text: a NUL at character {text.index(chr(0))}")
        chars = sorted(set(text))
        lookup = {ch: i for i, ch in enumerate(chars)}
        ids = np.fromiter((lookup[ch] for ch in text), dtype=np.uint16, count=len(text))
        cut = int(0.9 * len(ids))
        return _Stream(ids[:cut], ids[cut:], len(chars), seq_len, self.eval_samples, self.seed)


_TEXT_HEAD = 1 << 16  # bytes of a chars file the job reads to tell text from binary


def _not_text(raw: bytes, whole: bool) -> str | None:
    """What makes `raw` (a file's first bytes; `whole`: all of it) no UTF-8 text, or None."""
    if not raw:
        return "is empty: no characters"
    try:  # incremental: a character cut at the end of the head is no error
        codecs.getincrementaldecoder("utf-8")().decode(raw, final=whole)
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text: {exc.reason} at byte {exc.start}"
    if b"\0" in raw:  # valid UTF-8, but no text holds one: a binary file
        return f"is not text: a NUL byte at byte {raw.index(0)}"
    return None


def _check_eval_samples(eval_samples: int) -> None:
    if eval_samples < 0:
        raise Invalid(f"data.eval_samples={eval_samples} must be >= 0 (0: no held-out split, no eval_loss)")
