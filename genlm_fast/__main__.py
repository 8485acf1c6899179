"""``python -m genlm_fast {info,bench}`` (also installed as the ``genlm-fast`` script)."""

from __future__ import annotations

import argparse
import os
import platform
import sys


def info() -> int:
    import torch

    import genlm_fast
    from genlm_fast.ops import available_backends, resolve_backend
    from genlm_fast.ops import extension

    print(f"genlm_fast {genlm_fast.__version__}  python {platform.python_version()}  "
          f"torch {torch.__version__}")
    try:
        import triton

        print(f"triton {triton.__version__}  (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')})")
    except ImportError:
        print("triton: not installed")
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
        print(f"cuda: {torch.cuda.get_device_name()}  (torch CUDA {torch.version.cuda})")
    else:
        print("cuda: no device")
    for kind in ("cpu", "cuda"):
        status = "built" if extension.has(kind) else f"not available ({extension.why_missing(kind)})"
        print(f"extension[{kind}]: {status}")
    for device in devices:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            auto = resolve_backend("auto", device)
        print(f"{device}: backends {available_backends(device)}; auto -> {auto}")
    return 0


def bench(args) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, "bench")):
        print("`bench` runs from a source checkout of genlm_fast (the bench/ folder).", file=sys.stderr)
        return 2
    sys.path.insert(0, root)
    from bench import kernels

    rows = kernels.run(quick=args.quick)
    print(kernels.table(rows))
    if args.plot:
        kernels.plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="genlm-fast", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, built backends and what 'auto' picks")
    b = sub.add_parser("bench", help="kernel microbenchmarks side by side with genlm-backend")
    b.add_argument("--quick", action="store_true", help="Llama-3 only, B in {1, 32}")
    b.add_argument("--plot", metavar="PNG", help="also write a speedup-vs-batch plot")
    args = parser.parse_args(argv)
    return info() if args.command == "info" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
