"""Token data for the GPT-2 example, made locally (nothing is downloaded).

``python -m examples.hf_gpt2.data examples/hf_gpt2/tokens.npy`` writes a token file of a seeded synthetic language
(each token has a few likely successors, so there is something to learn) that ``data: {name: tokens_file}`` reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def synthetic_tokens(n_tokens: int = 65536, vocab_size: int = 128, branching: int = 4, seed: int = 0) -> np.ndarray:
    """A sparse Markov chain over ``vocab_size`` tokens: each token is followed by one of ``branching`` others."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
    picks = rng.integers(0, branching, size=n_tokens)
    out = np.empty(n_tokens, dtype=np.uint16)
    cur = 0
    for i in range(n_tokens):
        cur = int(successors[cur, picks[i]])
        out[i] = cur
    return out


def write_tokens(path: str | Path, n_tokens: int = 65536, vocab_size: int = 128, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, synthetic_tokens(n_tokens, vocab_size, seed=seed))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", nargs="?", default="examples/hf_gpt2/tokens.npy")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--vocab-size", type=int, default=128)
    args = parser.parse_args()
    write_tokens(args.path, args.tokens, args.vocab_size)


if __name__ == "__main__":
    main()
