"""The demo's text: generated from a small grammar, never downloaded.

A seeded ``random.Random`` expands a handful of sentence templates (a fable-like prose with
names, places, and a little arithmetic whose answers are always right), so the text is
identical on every machine, has structure a tiny model picks up within a few dozen steps
(spelling, spacing, punctuation, agreement), and costs no licence or network. Tokens are raw
UTF-8 bytes (vocabulary 256), so no tokenizer file is needed either.
"""
from __future__ import annotations

import random
from typing import Iterator, List, Tuple

import torch

__all__ = ["generate_text", "encode", "decode", "Batches"]

_NAMES = ["Ada", "Ben", "Cora", "Dov", "Elin", "Farid", "Gus", "Hana", "Ivo", "June"]
_ANIMALS = ["fox", "heron", "badger", "otter", "crow", "hare", "mole", "wren", "toad", "lynx"]
_ADJS = ["quiet", "old", "small", "bright", "clever", "tired", "brave", "grey", "quick", "patient"]
_PLACES = ["the mill", "the river", "the north field", "the orchard", "the bridge", "the market",
           "the old well", "the hill", "the harbour", "the forest edge"]
_THINGS = ["a lantern", "three apples", "a rope", "the map", "a basket of bread", "a letter",
           "a silver key", "two candles", "a kettle", "the ledger"]
_VERBS_PAST = ["found", "carried", "hid", "counted", "mended", "lost", "traded", "painted",
               "weighed", "guarded"]
_TIMES = ["At dawn", "Before noon", "In the evening", "On the first day", "After the rain",
          "Late at night", "When the bell rang", "By midsummer"]
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                 "ten", "eleven", "twelve"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(6)
    name, animal, adj = rng.choice(_NAMES), rng.choice(_ANIMALS), rng.choice(_ADJS)
    place, thing, verb = rng.choice(_PLACES), rng.choice(_THINGS), rng.choice(_VERBS_PAST)
    if kind == 0:
        return f"{rng.choice(_TIMES)}, {name} {verb} {thing} near {place}."
    if kind == 1:
        return f"The {adj} {animal} {verb} {thing} and went to {place}."
    if kind == 2:
        a, b = rng.randrange(7), rng.randrange(7)
        return f"{name} had {_NUMBER_WORDS[a]} and found {_NUMBER_WORDS[b]}, so {name} had {_NUMBER_WORDS[a + b]}."
    if kind == 3:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"{a} plus {b} is {a + b}."
    if kind == 4:
        other = rng.choice([n for n in _NAMES if n != name])
        verb_be = "is" if thing.startswith(("a ", "the ")) else "are"
        return f'"Where {verb_be} {thing}?" asked {name}. "At {place}," said {other}.'
    return f"{name} and the {adj} {animal} walked from {place} to {rng.choice(_PLACES)}."


def generate_text(num_bytes: int, seed: int = 0) -> str:
    """About ``num_bytes`` of text (whole sentences, paragraphs of 3 to 6), the same for a seed."""
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
    rng = random.Random(seed)
    parts: List[str] = []
    size = 0
    while size < num_bytes:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(3, 6))) + "\n\n"
        parts.append(para)
        size += len(para)
    return "".join(parts)


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes as a 1-D int64 tensor of token ids in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(tokens: "torch.Tensor | List[int]") -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class Batches:
    """Deterministic stream of (inputs, targets) windows cut from the generated text.

    Batch ``i`` depends only on ``(seed, i)``, so a second run (torch's AdamW in the loss
    comparison) sees exactly the same data as the first.
    """

    def __init__(self, *, batch_size: int, seq_len: int, seed: int = 0, num_bytes: int = 1 << 19) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        self.data = encode(generate_text(max(num_bytes, 4 * seq_len), seed=seed))
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch_size,), generator=gen)
        window = torch.stack([self.data[s: s + self.seq_len + 1] for s in starts.tolist()])
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        i = 0
        while True:
            yield self[i]
            i += 1
