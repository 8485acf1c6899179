"""A decoding forward on the CPU against the machine's floors, measured in the same run.

    python -m bench.lm_floor [--model smollm2|llama3.2-1b] [--dtype float32|bfloat16|float16]
                             [--rounds 7] [--cases 1x1,16x2] [--out FILE.md]

The floor of a forward is reading the weights once: the bytes genlm_fast's forward streams
(the fused decoder's packed copies, or where it does not run the model's own weights, which
the linear layers read in place) over the machine's read bandwidth, measured here by reading
a buffer of the same size as the forward's threads do (`stream_read` of
`bench/csrc/probes.cpp`: each thread its share as 1, 2 or 4 interleaved sequential streams,
with and without software prefetches 4 KB ahead; the fastest). Rows of new tokens also cost
arithmetic: two FLOPs per weight of the decoder layers per new token, and per weight of the
LM head per row (it runs on each row's last token only), at the FLOP/s of register-only
float32 multiply-adds on the same threads (its `fma_rate`, with the widest vector
instructions this CPU has: 16-bit weights are widened to float32 before they are
multiplied); a forward can be no faster than either floor.

Cases: 1, 4 and 16 rows x 1 and 2 new tokens over a cached past of 24 tokens (rows sharing a
15-token prompt, as SMC particles do). Each round runs every case on genlm_fast's forward
(``forward_path``: the fused decoder where it runs, else transformers' forward with
genlm_fast's linear layers, run through `engines.Forwards.run_on` with the trie insertions)
and on the plain alternative over the same stored key/values (the fused decoder:
transformers' forward with genlm_fast's linear layers, the path before it; otherwise:
transformers' own linear layers, as genlm-backend runs them), each case right after its own
measurement of both floors. A shared VM's bandwidth and FMA rate can move by 2x within
seconds, so a forward is compared with the floors of its own moment, and the table gives the
median over the rounds of those ratios (a best time over a best floor taken at different
moments can read below 1). Every case's logits are checked against a float64 forward of the
same weights first (max |log-prob error| over tokens > -20).

``--model llama3.2-1b`` is the Llama-3.2-1B architecture with the real Llama-3 vocabulary and
seeded weights (`genlm_fast.models.llama3_path`), the scale genlm's users run;
``--dtype bfloat16`` runs the model as most hub checkpoints load (``dtype="auto"``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.machine import machine_line
from bench.report import write_report

PROMPT = "In a quiet village at the edge of the forest, an old clockmaker"
MODELS = ("smollm2", "llama3.2-1b")
PAST = 24
CASES = [(1, 1), (1, 2), (4, 1), (4, 2), (16, 1), (16, 2)]


class Sample(NamedTuple):
    """One round of one case: the floors measured just before it and the forwards' seconds."""

    bandwidth: float  # bytes/s, the streaming read's best
    flops: float  # FLOP/s of register-only multiply-adds
    mine: float  # genlm_fast's forward
    other: float | None  # the comparison's (None: not run)


def _contexts(tokenizer, rows, new):
    """``rows`` contexts of PAST + new tokens: the prompt, then tokens of each row's own."""
    prompt = tokenizer.encode(PROMPT)
    g = torch.Generator().manual_seed(rows * 10 + new)
    return [
        tuple(prompt + torch.randint(100, 40000, (PAST + new - len(prompt),), generator=g).tolist())
        for _ in range(rows)
    ]


def _plans(lm, ctxs, new):
    """Each context's past (its first PAST tokens) stored in lm's trie, as `engines.Row`s."""
    from genlm_fast.backend.llm.plan import Row

    trie = lm._kv_trie(None)
    lm._forward(None, [c[:PAST] for c in ctxs])
    plans = []
    for c in ctxs:
        d, runs = trie.match(c, PAST)
        assert d == PAST
        plans.append(Row(c, d, runs))
    return plans, trie


def _floor_bandwidth(probes, buf, threads):
    """The fastest read of ``buf``: 1, 2 or 4 streams a thread, on the hardware prefetcher
    alone or with each line prefetched 4 KB ahead, as the panel kernels do."""
    best = 0.0
    for streams in (1, 2, 4):
        for ahead in (0, 4096):
            t = time.perf_counter()
            probes.stream_read(buf, streams, threads, ahead)
            best = max(best, buf.numel() * 4 / (time.perf_counter() - t))
    return best


def _model_path(model, dtype):
    from genlm_fast.models import llama3_path, smollm2_path

    if model == "smollm2":
        return smollm2_path()
    return llama3_path(model, str(dtype).removeprefix("torch."))


def run(rounds=7, cases=CASES, dtype=torch.float32, model="smollm2"):
    from transformers import AutoModelForCausalLM

    from bench import probes as probe_module
    from genlm_fast.backend.llm import AsyncTransformer
    from genlm_fast.backend.llm.cpu_linear import pack_linear_layers, unpack_linear_layers
    from genlm_fast.backend.llm.memory import shortfall
    from genlm_fast.backend.llm.packed_pages import collapse, empty
    from genlm_fast.ops import extension

    module, probes = extension.load_module(), probe_module.load()
    path = _model_path(model, dtype)
    lm = AsyncTransformer.from_name(path, hf_opts={"dtype": dtype})
    fused = lm.forward_path == "fused"
    head = lm.model.get_output_embeddings().weight.numel()
    # the decoder layers' weights (every new token) and the LM head's (each row's last one)
    params = sum(p.numel() for n, p in lm.model.named_parameters() if "embed" not in n)
    params -= 0 if lm.model.config.tie_word_embeddings else head
    mine = lm._forwards.fused if fused else lm._forwards.eager
    lm.settle()  # (timed on the 2 MB pages the panels end on)
    # accuracy first, the float64 model alone beside ours (a 1B float32 model's is 9.9 GB)
    ref64 = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).double().eval()
    contexts, my_plans, errors = {}, {}, {}
    with torch.no_grad():
        for rows, new in cases:
            ctxs = contexts[rows, new] = _contexts(lm.tokenizer, rows, new)
            my_plans[rows, new] = _plans(lm, ctxs, new)
            logits = lm._forwards.run_on(mine, *my_plans[rows, new])[0]
            got = torch.log_softmax(logits.double(), -1)
            want = torch.log_softmax(ref64(torch.tensor([list(c) for c in ctxs])).logits[:, -1], -1)
            errors[rows, new] = float((got - want)[want > -20].abs().max())
    del ref64
    nbytes = (
        lm._state.decoder.weight_bytes
        if fused
        else (params + head) * torch.empty((), dtype=dtype).element_size()
    )
    # the comparison model: two more copies where the fused decoder runs (its own decoder's
    # and its packed linear layers'), beside the floor's buffer; left out where they do not fit
    no_room = shortfall((3 if fused else 2) * nbytes, "the comparison model and the buffer")
    other, other_name, packed = None, f"not run ({no_room})", 0
    if no_room is None and fused:
        # the path before: transformers' forward on packed linear layers, its own model
        other = AsyncTransformer(
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype), lm.tokenizer
        )
        other._forwards.fused.max_tokens = 0
        other_name = "transformers, packed linears"
        packed = pack_linear_layers(other.model)
    elif no_room is None:  # the weights read in place, in the model's dtype
        other = AsyncTransformer(
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype),
            lm.tokenizer,
            cpu_linear="torch",
        )
        other_name = "transformers' own linears"
    setups = {
        case: (my_plans[case], other and _plans(other, contexts[case], case[1])) for case in cases
    }

    # as many bytes, on the kind of pages the panels end on
    buf = empty(nbytes // 4).fill_(1.0)
    collapse(buf)
    # the forward's team: as many threads as its parallel regions over these bytes get
    threads = module.cpu_team_size(nbytes)

    # every case's runs are paired with floors measured just before them: the VM's bandwidth
    # and FMA rate move by 2x within seconds, so a time is only compared with its own state's
    samples = {case: [] for case in cases}
    with torch.no_grad():
        for _ in range(rounds):
            for case in cases:
                bandwidth = _floor_bandwidth(probes, buf, threads)
                flops = probes.fma_rate(100_000_000, module.cpu_team_size(1 << 40))
                (plans, trie), theirs = setups[case]
                runs = [("genlm_fast", lambda p=plans, t=trie: lm._forwards.run_on(mine, p, t))]
                if other is not None:
                    runs.append(
                        (
                            "other",
                            lambda p=theirs[0], t=theirs[1]: other._forwards.run_on(
                                other._forwards.eager, p, t
                            ),
                        )
                    )
                times = {}
                for name, fn in runs:
                    t = time.perf_counter()
                    fn()
                    times[name] = time.perf_counter() - t
                samples[case].append(
                    Sample(bandwidth, flops, times["genlm_fast"], times.get("other"))
                )
    if packed:
        unpack_linear_layers(other.model)
    forward_path = lm.forward_path
    if other is not None:
        other.cleanup()
    lm.cleanup()
    return {
        "model": model,
        "forward_path": forward_path,
        "other": other_name,
        "isa": probes.isa(),
        "bytes": nbytes,
        "params": params,
        "head_params": head,
        "samples": samples,
        "errors": errors,
        "cases": cases,
        "dtype": str(dtype).removeprefix("torch."),
    }


def table(r):
    everything = [x for case in r["cases"] for x in r["samples"][case]]
    bandwidths = [x.bandwidth for x in everything]
    rates = [x.flops for x in everything]
    lines = [
        f"{r['model']} {r['dtype']}, one forward over a cached past of {PAST} tokens on "
        f"genlm_fast's `{r['forward_path']}` path: {r['bytes'] / 1e6:.0f} MB of weights, "
        f"{r['params'] / 1e6:.0f} M weights per new token and {r['head_params'] / 1e6:.0f} M "
        "(the LM head) per row. Each run is paired with the floors measured just before it: "
        f"streaming read {min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} GB/s, "
        f"{min(rates) / 1e9:.0f}-{max(rates) / 1e9:.0f} GFLOP/s of {r['isa']} float32 FMA "
        f"over the {len(everything)} runs. `x floor`: the median over the rounds of a run's "
        "time over its own floors; `speedup`: the median of the rounds' ratios.",
        "",
        "| rows x new | genlm_fast ms (best) | x memory floor | x max(memory, FMA) floor | "
        f"{r['other']} ms (best) | speedup | max err vs f64 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rows, new in r["cases"]:
        runs = r["samples"][rows, new]
        fma = 2 * (r["params"] * rows * new + r["head_params"] * rows)
        memory = [x.mine * x.bandwidth / r["bytes"] for x in runs]
        floor = [x.mine / max(r["bytes"] / x.bandwidth, fma / x.flops) for x in runs]
        mine = min(x.mine for x in runs)
        theirs = "- | -"
        if runs[0].other is not None:
            speedup = statistics.median(x.other / x.mine for x in runs)
            theirs = f"{min(x.other for x in runs) * 1e3:.1f} | {speedup:.2f}x"
        lines.append(
            f"| {rows} x {new} | {mine * 1e3:.1f} | {statistics.median(memory):.2f} | "
            f"{statistics.median(floor):.2f} | {theirs} | {r['errors'][rows, new]:.1e} |"
        )
    return "\n".join(lines)


def dtype_names():
    """The weight dtypes the fused decoder runs, by name: the LM benchmarks' choices."""
    from genlm_fast.backend.llm.decoder import WEIGHT_DTYPES

    return [str(d).removeprefix("torch.") for d in WEIGHT_DTYPES]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=MODELS)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--cases",
        default=",".join(f"{r}x{n}" for r, n in CASES),
        help="rows x new tokens, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=dtype_names(), help="the model's weights"
    )
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    dtype = getattr(torch, args.dtype)
    text = f"{machine_line()}\n\n{table(run(args.rounds, cases, dtype, args.model))}\n"
    write_report(text, args.out)


if __name__ == "__main__":
    main()
