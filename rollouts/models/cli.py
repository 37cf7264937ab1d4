"""`rollouts make-tiny-model DIR`: build a tiny model and tokenizer locally."""

from __future__ import annotations

import argparse
from pathlib import Path

from rollouts.models.tiny import TOKENIZERS, TinyModelSpec, make_tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `rollouts make-tiny-model`."""
    defaults = TinyModelSpec()
    parser.add_argument("dir", help="output directory (HF format)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default=defaults.tokenizer)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--num-heads", type=int, default=defaults.num_heads)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--max-positions", type=int, default=defaults.max_position_embeddings)
    parser.add_argument("--corpus", help="text file the BPE tokenizer is trained on")
    parser.add_argument(
        "--tie-embeddings", action="store_true", help="the LM head shares the embedding matrix"
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Build and save the model; print where it went."""
    spec = TinyModelSpec(
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_positions,
        tie_embeddings=args.tie_embeddings,
        seed=args.seed,
    )
    corpus = Path(args.corpus).read_text().splitlines() if args.corpus else []
    out = make_tiny_model(args.dir, spec, corpus)
    print(f"tiny model written to {out}")
    return 0
