"""The demo's training text: a deterministic synthetic corpus with learnable structure, as bytes.

Four kinds of lines, drawn from a fixed-seed generator (no files, no network):

* sentences of a small grammar with number agreement (``the old cats chase a red ball.``);
* facts about named objects, then a question that needs the fact again (a copy over
  distance: ``zorp is green. ... what color is zorp? green.``);
* sums of small numbers (``17+25=42;``);
* counting runs (``count 4 5 6 7 8.``).

Every process generates the same bytes. Batches are windows of the corpus chosen by a
generator seeded from ``(seed, step)``, so all ranks draw the same global batch and each
data-parallel rank keeps its slice.
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

__all__ = ["Corpus", "generate_text"]

_NOUNS = ("cat", "dog", "bird", "fox", "child", "robot", "farmer", "king", "wolf", "sailor")
_VERBS = ("see", "chase", "find", "like", "carry", "follow", "paint", "watch")
_ADJECTIVES = ("old", "small", "happy", "quiet", "brave", "lazy", "clever", "tall")
_COLORS = ("red", "green", "blue", "yellow", "white", "black", "purple", "orange")
_OBJECTS = ("ball", "box", "hat", "boat", "apple", "key", "lamp", "book")
_SYLLABLES = ("zo", "ka", "mi", "ru", "pe", "lo", "ta", "vi", "ne", "shu", "bo", "ga")

CORPUS_SEED = 20_240_901  # the text never changes; ``--seed`` moves init and batch order only


def _noun_phrase(rng: random.Random, plural: bool) -> str:
    words = [rng.choice(("the", "some")) if plural else rng.choice(("the", "a"))]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    noun = rng.choice(_NOUNS)
    if plural:
        noun = "children" if noun == "child" else noun + ("es" if noun.endswith("x") else "s")
    words.append(noun)
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    plural = rng.random() < 0.5
    subject = _noun_phrase(rng, plural)
    verb = rng.choice(_VERBS)
    if not plural:
        verb += "es" if verb.endswith(("sh", "ch", "x")) else "s"
    obj = f"{rng.choice(('a', 'the'))} {rng.choice(_COLORS)} {rng.choice(_OBJECTS)}"
    return f"{subject} {verb} {obj}."


def _fact(rng: random.Random) -> str:
    name = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))
    color = rng.choice(_COLORS)
    filler = _sentence(rng)
    return f"{name} is {color}. {filler} what color is {name}? {color}."


def _sum(rng: random.Random) -> str:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return f"{a}+{b}={a + b};"


def _count(rng: random.Random) -> str:
    start = rng.randint(0, 90)
    return "count " + " ".join(str(start + i) for i in range(rng.randint(4, 8))) + "."


def generate_text(num_bytes: int, seed: int = CORPUS_SEED) -> bytes:
    """At least ``num_bytes`` bytes of corpus, the same for the same arguments.

    Raises:
        ValueError: If ``num_bytes`` is not positive.
    """
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be positive, got {num_bytes!r}")
    rng = random.Random(seed)
    kinds = (_sentence, _fact, _sum, _count)
    weights = (0.4, 0.3, 0.15, 0.15)
    parts: list[str] = []
    size = 0
    while size < num_bytes:
        line = rng.choices(kinds, weights)[0](rng) + "\n"
        parts.append(line)
        size += len(line)
    return "".join(parts).encode("ascii")


class Corpus:
    """The corpus as a byte tensor, split into training and held-out text.

    Args:
        num_bytes: Size of the whole corpus.
        eval_fraction: Share held out for evaluation (taken from the end).
    """

    def __init__(self, num_bytes: int = 400_000, eval_fraction: float = 0.1) -> None:
        if not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        data = torch.frombuffer(bytearray(generate_text(num_bytes)), dtype=torch.uint8)
        cut = int(len(data) * (1 - eval_fraction))
        self.train = data[:cut].long()
        self.held_out = data[cut:].long()

    @staticmethod
    def _windows(data: Tensor, starts: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        idx = starts[:, None] + torch.arange(seq_len + 1)
        window = data[idx]
        return window[:, :-1], window[:, 1:]

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> tuple[Tensor, Tensor]:
        """The global training batch of ``step``: inputs and next-byte targets ``(batch, seq)``."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - seq_len - 1, (batch_size,), generator=gen)
        return self._windows(self.train, starts, seq_len)

    def eval_batch(self, batch_size: int, seq_len: int) -> tuple[Tensor, Tensor]:
        """A fixed held-out batch (evenly spaced windows), the same for every seed."""
        last = len(self.held_out) - seq_len - 1
        starts = torch.linspace(0, last, batch_size).long()
        return self._windows(self.held_out, starts, seq_len)


def shard_rows(x: Tensor, rank: int, num_shards: int) -> Tensor:
    """Rows ``rank`` of ``num_shards`` equal blocks of ``x`` (a data-parallel rank's slice).

    Raises:
        ValueError: If the rows do not split evenly.
    """
    if x.shape[0] % num_shards:
        raise ValueError(f"batch of {x.shape[0]} does not split over {num_shards} ranks")
    size = x.shape[0] // num_shards
    return x[rank * size : (rank + 1) * size]
