"""`rollouts serve --model DIR [--host 127.0.0.1] [--port N] [--api-key K] [--max-batch N] ...`.

Runs the built-in engine server until killed. See `rollouts.inference.server` for the routes and
for what `--logprobs-from raw|scaled` means (raw = log_softmax of the unmodified logits, the
default; scaled = log_softmax of the temperature-scaled logits).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

DECODE_PATHS = ("auto", "eager", "hf")  # ServeOptions.decode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `rollouts serve`."""
    parser.add_argument("--model", required=True, help="HF-format model directory")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default="", help="require 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without --api-key (anyone who reaches the port can "
        "generate, pause, abort and reload weights)",
    )
    parser.add_argument(
        "--weights-root",
        action="append",
        default=[],
        metavar="DIR",
        help="weight reloads only from inside DIR (repeatable); without it, from any path",
    )
    parser.add_argument(
        "--max-body-mb", type=float, default=64.0, help="larger request bodies get 413"
    )
    parser.add_argument("--max-batch", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--max-queue", type=int, default=1024, help="waiting sequences; then 503")
    parser.add_argument("--max-prefill", type=int, default=64, help="new sequences per step")
    parser.add_argument(
        "--logprobs-from",
        choices=("raw", "scaled"),
        default="raw",
        help="logprob of a sampled token from the raw logits or the temperature-scaled ones",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--autocast",
        default="off",
        choices=("off", "bfloat16", "float16"),
        help="compute what a trainer under torch.autocast in this dtype computes (with --dtype "
        "float32): linear weights held in it, embeddings, norms and the residual stream float32",
    )
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=("sdpa", "eager"),
        help="the HF forward's attention (prefill, prompt logprobs): the trainer's, so that a "
        "16-bit engine computes its function (the engine's own decode step is eager's)",
    )
    parser.add_argument(
        "--decode",
        choices=DECODE_PATHS,
        default="auto",
        help="decode steps: 'auto' = the engine's own step for Llama and Qwen2 models (the HF "
        "forward for others), replayed as CUDA graphs on a GPU; 'eager' = the same step without "
        "graphs; 'hf' = always the HF forward",
    )
    parser.add_argument(
        "--share-prefix",
        choices=("on", "off"),
        default="on",
        help="prefill the token prefix that new prompts share (an agent's system message, a "
        "group's question) once, and keep it for the next ones while the weights stay: 'off' "
        "prefills every prompt whole",
    )
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads (0 = torch's default); 1 avoids OpenMP spin-waits when the "
        "server shares a few CPU cores with a trainer",
    )
    parser.add_argument(
        "--cpus",
        default="",
        metavar="LIST",
        help="run on these CPU cores only, e.g. 1 or 2,3 (Linux; default: all the process may use)",
    )


def parse_cpus(text: str) -> set[int] | None:
    """`--cpus` "2,3" -> {2, 3}; "" -> None (not pinned); ValueError naming the flag if bad."""
    if not text.strip():
        return None
    try:
        cores = {int(part) for part in text.split(",")}
    except ValueError:
        raise ValueError(
            f"--cpus {text!r}: a comma-separated list of core numbers, e.g. 1,2"
        ) from None
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else cores
    if not cores <= allowed:
        raise ValueError(f"--cpus {text!r}: this process may only use cores {sorted(allowed)}")
    return cores


def options_from_args(args: argparse.Namespace) -> Any:
    """The parsed command line as ServeOptions (imported here: torch loads only when serving)."""
    from rollouts.inference.server.app import ServeOptions

    return ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_prefill=args.max_prefill,
        logprobs_from=args.logprobs_from,
        device=args.device,
        dtype=args.dtype,
        autocast=args.autocast,
        attn_implementation=args.attn_implementation,
        decode=args.decode,
        share_prefix=args.share_prefix == "on",
        weight_version=args.weight_version,
        served_model_name=args.served_model_name,
        request_timeout_s=args.request_timeout_s,
        weights_roots=tuple(str(Path(r).resolve()) for r in args.weights_root),
        max_body_mb=args.max_body_mb,
    )


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is reachable only from this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line (the message to print), or None."""
    if not (Path(args.model) / "config.json").is_file():
        return f"--model {args.model}: no config.json there (an HF model directory?)"
    for name in ("max_batch", "max_queue", "max_prefill"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    try:
        parse_cpus(args.cpus)
    except ValueError as e:
        return str(e)
    if args.max_body_mb <= 0:
        return f"--max-body-mb {args.max_body_mb} must be > 0"
    for root in args.weights_root:  # it may appear later (a trainer's first weight copy)
        if Path(root).exists() and not Path(root).is_dir():
            return f"--weights-root {root}: not a directory"
    if not args.api_key and not args.allow_unauthenticated and not is_loopback(args.host):
        return (
            f"--host {args.host} is reachable from other machines and no --api-key is set: "
            "anyone could reload weights, pause or abort. Set --api-key KEY, or pass "
            "--allow-unauthenticated if the network is trusted"
        )
    return None


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 when the model directory or an option is unusable."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    if (error := usage_error(args)) is not None:
        print(f"rollouts serve: {error}", file=sys.stderr)
        return 2
    cores = parse_cpus(args.cpus)
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)  # before torch starts any thread: they all inherit it
    import torch
    import trio

    from rollouts.inference.server.app import serve

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)

    try:
        trio.run(serve, options_from_args(args))
    except KeyboardInterrupt:
        return 0
    return 0
