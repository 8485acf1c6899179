"""A decoding forward on the CPU against the machine's floors, measured in the same run.

    python -m bench.lm_floor [--model smollm2|llama3.2-1b] [--dtype float32|bfloat16|float16]
                             [--rounds 7] [--cases 1x1,16x2] [--out FILE.md]

The floor of a forward is reading the weights once: the bytes genlm_fast's forward streams
(the fused decoder's packed copies, or where it does not run the model's own weights, which
the linear layers read in place) over the machine's read bandwidth, measured here by reading
a buffer of the same size as the forward's threads do (`stream_read` of
`bench/csrc/probes.cpp`: each thread its share as 1, 2 or 4 interleaved sequential streams;
the fastest). Rows of new tokens also cost arithmetic: two FLOPs per weight of the decoder
layers per new token, and per weight of the LM head per row (it runs on each row's last
token only), at the FLOP/s of register-only float32 multiply-adds on the same threads (its
`fma_rate`, with the widest vector instructions this CPU has: 16-bit weights are widened to
float32 before they are multiplied); a forward can be no faster than either floor.

Cases: 1, 4 and 16 rows x 1 and 2 new tokens over a cached past of 24 tokens (rows sharing
a 15-token prompt, as SMC particles do). Each round measures the bandwidth, then every case
on genlm_fast's forward (``forward_path``: the fused decoder where it runs, else
transformers' forward with genlm_fast's linear layers, run through `engines.Forwards.run_on`
with the trie insertions) and on the plain alternative over the same stored key/values (the
fused decoder: transformers' forward with genlm_fast's linear layers, the path before it;
otherwise: transformers' own linear layers, as genlm-backend runs them); the best of the
rounds is kept for each (a shared VM's bandwidth moves by 2x within minutes: measuring
everything in every round keeps the ratios honest). Every case's logits are checked against
a float64 forward of the same weights first (max |log-prob error| over tokens > -20).

``--model llama3.2-1b`` is the Llama-3.2-1B architecture with the real Llama-3 vocabulary and
seeded weights (`genlm_fast.models.llama3_path`), the scale genlm's users run;
``--dtype bfloat16`` runs the model as most hub checkpoints load (``dtype="auto"``).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from bench.machine import machine_line
from bench.report import write_report

PROMPT = "In a quiet village at the edge of the forest, an old clockmaker"
MODELS = ("smollm2", "llama3.2-1b")
PAST = 24
CASES = [(1, 1), (1, 2), (4, 1), (4, 2), (16, 1), (16, 2)]


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
    best = 0.0
    for streams in (1, 2, 4):
        t = time.perf_counter()
        probes.stream_read(buf, streams, threads)
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

    bandwidth, flops, best = 0.0, 0.0, {}
    with torch.no_grad():
        for _ in range(rounds):
            bandwidth = max(bandwidth, _floor_bandwidth(probes, buf, threads))
            flops = max(flops, probes.fma_rate(100_000_000, module.cpu_team_size(1 << 40)))
            for case in cases:
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
                for name, fn in runs:
                    t = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t
                    best[case, name] = min(best.get((case, name), float("inf")), dt)
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
        "bandwidth": bandwidth,
        "bytes": nbytes,
        "flops": flops,
        "params": params,
        "head_params": head,
        "best": best,
        "errors": errors,
        "cases": cases,
        "dtype": str(dtype).removeprefix("torch."),
    }


def table(r):
    mem_floor = r["bytes"] / r["bandwidth"]
    lines = [
        f"{r['model']} {r['dtype']}, one forward over a cached past of {PAST} tokens on "
        f"genlm_fast's `{r['forward_path']}` path. "
        f"Memory floor: {r['bytes'] / 1e6:.0f} MB of weights at "
        f"{r['bandwidth'] / 1e9:.1f} GB/s (streaming read, same run) = "
        f"{mem_floor * 1e3:.2f} ms; arithmetic: {r['flops'] / 1e9:.0f} GFLOP/s of {r['isa']} "
        f"float32 FMA, {r['params'] / 1e6:.0f} M weights per new token and "
        f"{r['head_params'] / 1e6:.0f} M (the LM head) per row.",
        "",
        "| rows x new | genlm_fast ms | x memory floor | x max(memory, FMA) floor | "
        f"{r['other']} ms | speedup | max err vs f64 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rows, new in r["cases"]:
        mine, other = r["best"][(rows, new), "genlm_fast"], r["best"].get(((rows, new), "other"))
        fma = 2 * (r["params"] * rows * new + r["head_params"] * rows)
        floor = max(mem_floor, fma / r["flops"])
        theirs = "- | -" if other is None else f"{other * 1e3:.1f} | {other / mine:.2f}x"
        lines.append(
            f"| {rows} x {new} | {mine * 1e3:.1f} | {mine / mem_floor:.2f} | "
            f"{mine / floor:.2f} | {theirs} | {r['errors'][rows, new]:.1e} |"
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
