"""Text for the main job (examples/train.py): a corpus every machine has, split by file, read as bytes.

* **Corpus**: by default the Python standard library's own source files (``sysconfig``'s
  ``stdlib`` path, ``*.py``, site-packages left out): about 30 MB of real text on any machine with
  Python, nothing to download. ``--data PATH`` takes a text file or a directory of them
  (``*.txt``, ``*.md``, ``*.py``, ``*.rst``, read recursively).
* **Split**: by file, deterministically: a file whose path's CRC-32 is divisible by 20 is held out
  for validation (about 5%), so no validation text was trained on, on any machine.
* **Tokens**: bytes (a vocabulary of 256). Nothing to train or cache, and a loss in nats per
  token is a loss per byte: bits per byte = loss / ln 2, comparable across tokenizers.
* **Batches**: the training stream is cut into sequences of ``seq_len + 1`` bytes (inputs and
  targets shifted by one). Epoch ``e`` visits them in the order of a permutation drawn from
  ``seed + e``; global step ``s`` takes the next ``batch`` sequences of that order, and rank ``r``
  of ``w`` takes its ``batch / w`` of them. The global batch of a step depends only on the step,
  not on the world size (so a run resumes at another world size on the same data), no two ranks
  see the same sequence in a step, and the data position is the step number itself.
"""

from __future__ import annotations

import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.rglob("*.py") if "site-packages" not in f.parts and f.is_file())


def user_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        if found:
            return found
        raise SystemExit(f"--data {path}: no text files ({', '.join(TEXT_SUFFIXES)}) under it.")
    raise SystemExit(f"--data {path}: no such file or directory.")


def is_validation(path: Path, root: Path) -> bool:
    rel = path.relative_to(root).as_posix() if path != root else path.name
    return zlib.crc32(rel.encode()) % 20 == 0


@dataclass
class Corpus:
    train: torch.Tensor  # uint8, the training files one after another
    val: torch.Tensor  # uint8, the held-out files
    files: tuple[int, int]  # (train files, validation files)
    source: str

    def unigram_bits_per_byte(self) -> float:
        """The entropy of the training bytes' frequencies: what a model that ignores context scores."""
        counts = torch.bincount(self.train.long(), minlength=256).double()
        p = counts[counts > 0] / counts.sum()
        return float(-(p * p.log2()).sum())


def load_corpus(data: str | None, max_bytes: int | None = None) -> Corpus:
    """Read the corpus (the standard library's sources when ``data`` is None) and split it by file.
    ``max_bytes`` keeps the first files up to that many bytes (a shorter run on a smaller corpus)."""
    if data is None:
        files, root, source = stdlib_files(), Path(sysconfig.get_paths()["stdlib"]), "the Python standard library"
    else:
        files, source = user_files(data), data
        root = Path(data) if Path(data).is_dir() else Path(data).parent
    train: list[bytes] = []
    val: list[bytes] = []
    total = 0
    for f in files:
        text = f.read_bytes()
        (val if is_validation(f, root) and len(files) > 1 else train).append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    if not val:  # one file: its last 5% is the validation text
        whole = b"".join(train)
        cut = int(len(whole) * 0.95)
        train, val = [whole[:cut]], [whole[cut:]]
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(val), (len(train), len(val)), source)


class Batches:
    """The global batch of any step (see the module docstring) and this rank's part of it."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> None:
        self.sequences = stream[: (len(stream) - 1) // seq_len * seq_len + 1]
        self.count = (len(self.sequences) - 1) // seq_len
        if self.count < batch:
            raise SystemExit(
                f"the text holds {self.count} sequences of {seq_len + 1} bytes, fewer than one batch of {batch}. "
                "Fix: a smaller --batch or --seq-len, or more text (--data)."
            )
        self.seq_len, self.batch, self.seed = seq_len, batch, seed
        self.steps_per_epoch = self.count // batch
        self._order: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.count, generator=gen))
        return self._order[1]

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of a global step."""
        return divmod(step, self.steps_per_epoch)

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, k = self.position(step)
        return self._permutation(epoch)[k * self.batch : (k + 1) * self.batch]

    def rank_batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self.global_indices(step).chunk(world)[rank]
        return self.sequences_at(mine)

    def sequences_at(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = indices * self.seq_len
        rows = torch.stack([self.sequences[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]


def validation_indices(batches: Batches, n_batches: int) -> list[torch.Tensor]:
    """The first ``n_batches`` global batches of the validation text, in order (the same every eval)."""
    n = min(n_batches * batches.batch, batches.count)
    return list(torch.arange(n).split(batches.batch))


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)


def describe(corpus: Corpus) -> str:
    mb = lambda t: f"{t.numel() / 1e6:.1f} MB"  # noqa: E731
    return (
        f"corpus: {corpus.source}: train {mb(corpus.train)} in {corpus.files[0]} files, validation "
        f"{mb(corpus.val)} in {corpus.files[1]} files (held out by file); tokens are bytes"
    )
