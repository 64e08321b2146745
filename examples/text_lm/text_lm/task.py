"""The model, the data and the training loop: plain PyTorch, no federated code at all.

The data is the Python standard library's own source, which every machine with Python has
(no download): each site holds whole packages (asyncio, email, json, ...), so the sites'
code differs in vocabulary and style, a naturally non-IID split; the server evaluates on
the top-level modules (os.py, typing.py, ...), which no site holds. The model is a small
causal transformer that predicts each next byte of a 64-byte window.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CONTEXT = 64  # bytes a window predicts from; a window holds CONTEXT + 1 bytes
VOCABULARY = 256  # one token per byte value
# Packages that are data, or tests of the library rather than the library itself.
LEFT_OUT = frozenset({"test", "encodings", "pydoc_data", "__phello__", "site-packages"})
TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})
UNIFORM_LOSS = math.log(VOCABULARY)  # nats per byte of a model that knows nothing


class DataError(ValueError):
    """The standard library's source cannot give the sites what they need."""


def stdlib_dir() -> Path:
    """Where this Python's standard library source lives."""
    return Path(sysconfig.get_paths()["stdlib"])


@dataclass(frozen=True)
class Package:
    """A unit of source a site may hold: a package's files (or part of a large one's)."""

    name: str
    files: tuple[Path, ...]

    @property
    def size(self) -> int:
        return sum(file.stat().st_size for file in self.files)


@cache
def packages(root: Path) -> tuple[Package, ...]:
    """The library's packages under ``root``, by name, each with its source files
    (its own tests left out)."""
    found = []
    for folder in sorted(root.iterdir()):
        if folder.name in LEFT_OUT or not (folder / "__init__.py").is_file():
            continue
        files = tuple(
            sorted(
                file
                for file in folder.rglob("*.py")
                if not TEST_FOLDERS & set(file.relative_to(folder).parts[:-1])
            )
        )
        if files:
            found.append(Package(folder.name, files))
    return tuple(found)


def site_packages(root: Path, num_sites: int) -> list[list[Package]]:
    """The packages of each of ``num_sites`` sites: whole packages, balanced by size.

    Largest first, each to the site with the fewest bytes so far. With more sites than
    packages, the largest package is split in two (by its files, in order) until there are
    enough; every site then holds code of one package at least.
    """
    units = list(packages(root))
    if num_sites < 1:
        raise DataError(f"num_sites must be at least 1, got {num_sites}")
    while len(units) < num_sites:
        splittable = [u for u in units if len(u.files) > 1]
        if not splittable:
            raise DataError(
                f"the standard library at {root} has {len(units)} source units to share; "
                f"{num_sites} sites asked for more"
            )
        largest = max(splittable, key=lambda u: u.size)
        half = len(largest.files) // 2
        units.remove(largest)
        units += [
            Package(f"{largest.name}[1]", largest.files[:half]),
            Package(f"{largest.name}[2]", largest.files[half:]),
        ]
    held: list[list[Package]] = [[] for _ in range(num_sites)]
    sizes = [0] * num_sites
    for unit in sorted(units, key=lambda u: (-u.size, u.name)):
        site = sizes.index(min(sizes))
        held[site].append(unit)
        sizes[site] += unit.size
    return held


def site_name(partition_id: int, num_partitions: int, root: Path | None = None) -> str:
    """A site's name: its largest package's (``asyncio``, ``email``, ...)."""
    held = site_packages(root or stdlib_dir(), num_partitions)[partition_id]
    return max(held, key=lambda u: u.size).name


def windows(files: tuple[Path, ...] | list[Path], count: int, seed: int) -> torch.Tensor:
    """``count`` windows of ``CONTEXT + 1`` bytes, (count, CONTEXT + 1) int64, drawn at
    seeded non-overlapping positions of the files' concatenated bytes (fewer if the text
    is shorter)."""
    text = np.frombuffer(b"\n".join(file.read_bytes() for file in files), dtype=np.uint8)
    span = CONTEXT + 1
    starts = np.arange(0, len(text) - span + 1, span)
    chosen = np.sort(np.random.default_rng(seed).permutation(starts)[:count])
    return torch.from_numpy(text[chosen[:, None] + np.arange(span)].astype(np.int64))


def load_data(
    partition_id: int, num_partitions: int, *, windows_per_site: int, root: Path | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This site's windows of its packages' source: the first tenth, in file order (a
    hold-out by file), to validate on, the rest to train on."""
    held = site_packages(root or stdlib_dir(), num_partitions)[partition_id]
    files = [file for unit in held for file in unit.files]
    data = windows(files, windows_per_site, seed=partition_id)
    n_val = max(1, len(data) // 10)
    return data[n_val:], data[:n_val]


def load_test_data(count: int = 1024, root: Path | None = None) -> torch.Tensor:
    """The server's held-out windows: the top-level modules, which no site holds."""
    modules = sorted((root or stdlib_dir()).glob("*.py"))
    if not modules:
        raise DataError(
            f"no Python source in {root or stdlib_dir()}: this Python's standard library "
            "was installed without its source"
        )
    return windows(modules, count, seed=12345)


class Block(nn.Module):
    """Pre-norm causal self-attention and an MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ByteTransformer(nn.Module):
    """A small causal transformer over bytes: (N, T) int64 in, (N, T, 256) logits out."""

    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, width)
        self.position = nn.Parameter(torch.randn(CONTEXT, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY, bias=False)
        # True above the diagonal: a position may not attend to the bytes after it.
        mask = torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position[:length]
        causal = self.causal[:length, :length]
        for block in self.blocks:
            x = block(x, causal)
        return self.head(self.norm(x))


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each next byte, in nats."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCABULARY), batch[:, 1:].reshape(-1))


def site_seed(seed: int, server_round: int, partition_id: int) -> int:
    """The batches' seed of this run, round and site: every triple its own (a sum like
    seed + round would give seed 1's round 1 the batches of seed 0's round 2)."""
    return int(np.random.SeedSequence([seed, server_round, partition_id]).generate_state(1)[0])


def train(
    model: nn.Module,
    data: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> float:
    """AdamW for ``steps`` mini-batches drawn with ``seed``; the mean loss.

    The optimizer starts afresh each call (the site keeps no state between rounds).
    """
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(steps):
        batch = data[torch.randint(len(data), (batch_size,), generator=generator)]
        optimizer.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        optimizer.step()
        total += loss.item()
    return total / max(1, steps)


def test(model: nn.Module, data: torch.Tensor, batch_size: int = 256) -> tuple[float, float]:
    """Mean loss per byte (nats) and next-byte accuracy of ``model`` on ``data``."""
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in data.split(batch_size):
            logits = model(batch[:, :-1])
            target = batch[:, 1:]
            loss += F.cross_entropy(
                logits.reshape(-1, VOCABULARY), target.reshape(-1), reduction="sum"
            ).item()
            correct += int((logits.argmax(-1) == target).sum())
            count += target.numel()
    return loss / count, correct / count
