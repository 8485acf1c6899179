"""The trie kernels of one call shape, for a kernel profiler on the GPU machine:

    ncu --kernel-name regex:'row_pass|tile_kernel|span_kernel' --launch-skip 6 \\
        --launch-count 3 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section WarpStateStats \\
        python -m tools.gpu.profile_call --op log_mass --batch 64

Builds the vocabulary's trie (Llama-3 by default, as ``tools.gpu.bench``), then runs the backend's
kernels alone (``dispatch.run_backend``) ``--calls`` times (default 3) on random logits (sum
and max: their softmax): with the selection above, ncu skips the first two calls' row pass,
tile and span kernels and profiles the third's (the row pass: every op, staging the rows
from B=8 on). ``tools/gpu/session.sh profile`` runs it so.
``--dry-run-cpu`` runs the same on a few hundred tokens on the CPU (Triton interpreter): CI
checks the script that way.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=("log_mass", "sum", "max"), default="log_mass")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--backend", default="cuda", help="cuda (default) or triton")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--vocab", default="llama3", help="quicktok encoding (default llama3)")
    parser.add_argument("--dry-run-cpu", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from bench.tries import make_inputs
    from genlm_fast.bytes import TokenByteTrie
    from tools.gpu.measure import kernel_call
    from tools.gpu.trie_vocab import DRY_RUN_TOKENS, load_vocab

    device = "cpu" if args.dry_run_cpu else "cuda"
    backend = "triton" if args.dry_run_cpu else args.backend
    label, vocab = load_vocab(args.vocab, None, limit=DRY_RUN_TOKENS if args.dry_run_cpu else None)
    layout = TokenByteTrie(vocab, device=device, kernel_backend=backend).layout
    logits, probs = make_inputs(len(vocab), args.batch)
    x = (logits if args.op == "log_mass" else probs).to(device).contiguous()
    call = kernel_call(backend, x, layout, args.op)
    for _ in range(args.calls):
        out = call()
    if device == "cuda":
        torch.cuda.synchronize()
    print(
        f"{label}: {layout.num_nodes} nodes; {args.calls} calls of {backend} {args.op} "
        f"B={args.batch} -> {tuple(out.shape)}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
