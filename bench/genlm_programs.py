"""genlm-control's example programs (`bench.programs`), timed on genlm and on genlm_fast.

    python -m bench.genlm_programs                        # all programs, best of 3, + profile
    python -m bench.genlm_programs --rounds 5 --out bench/results/genlm-programs-cpu-DATE.md
    python -m bench.genlm_programs --programs basic product --no-profile

Each implementation runs in a worker process of its own (genlm-control on the real
genlm-backend / genlm-bytes, or on genlm_fast through ``genlm_fast.dropin``; the import hook
and the real packages never meet), which loads SmolLM2 once (untimed) and then runs the
programs it is asked for, one at a time, on that model. The two workers take turns: each
round runs every program on one implementation then the other (which goes first alternates
from round to round), so that a burst of load on this shared machine falls on both alike;
the figure per (program, implementation) is the best round. Every run starts from emptied
LM caches with every random source seeded alike (`bench.programs.run_program`), so both
implementations sample the same particles as long as their probabilities agree; a round
whose particles differ between the two is flagged in the table.

Then, unless ``--no-profile``, one more run of each program per implementation under a
stack sampler (`bench.stack_sampler`: a thread reading the main thread's stack every
millisecond) splits its time by where it is spent: the model's forward (transformers /
torch modules), the LM backend (batching, caches: genlm.backend's or genlm_fast's ``llm``
package), the tries, the byte beam (genlm.bytes' or genlm_fast.bytes' beam), genlm-control
and genlm-grammar's own Python, and the rest (the event loop, glue). Each sample goes to the
innermost frame that belongs to one of these; the shares are applied to the program's best
time.

The report (markdown: machine, the table of best times and ratios, their geometric mean,
the profile) is printed and, with ``--out``, written there with a plot beside it (same name,
``.png``). Importable: `Workers` (the pair of worker processes), `run_rounds`, `profile`,
`report`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from bench.report import command_line, write_report
from bench.stack_sampler import PROFILE_COLUMNS, StackSampler
from bench.workers import Worker, child_env, serve

IMPLS = ("genlm", "genlm_fast")
GOAL_EACH = 1.5
GOAL_GEOMEAN = 4.0

# ---------------------------------------------------------------- the worker


def _outcome_json(outcome):
    return {
        "particles": [[text.hex(), weight] for text, weight in outcome.particles],
        "scores": outcome.scores,
        "constraint": outcome.constraint,
    }


def _lm_counter(llm):
    """A function giving (model calls, contexts run) so far: genlm_fast's own ``stats``;
    for genlm, counted around its batch evaluation (one padded forward per call)."""
    if hasattr(llm, "stats"):
        return lambda: (llm.stats["batches"], llm.stats["rows"])
    counts = [0, 0]
    evaluate = llm._evaluate_queries

    def counting(queries):
        counts[0] += 1
        counts[1] += len({tuple(q.prompt) for q in queries})
        return evaluate(queries)

    llm._evaluate_queries = counting
    return lambda: tuple(counts)


def worker(impl: str, model_path: str | None = None) -> None:
    """Serve the driver (`bench.workers.serve`) with the model at ``model_path`` (None:
    SmolLM2): first what was loaded (``{"ready",
    "load_seconds", "lm"}``), then for each request ``{"program", "seed", "profile"}`` the
    reply ``{"seconds", "outcome", "lm_calls", "lm_rows", "violations", "profile"}``."""
    import asyncio

    if impl == "genlm_fast":
        import genlm_fast.dropin  # noqa: F401  (before anything imports genlm.backend)
    import genlm.bytes  # noqa: F401  (imports are not part of a program's time)
    import genlm.control  # noqa: F401

    from bench import programs

    loaded = {}

    def load():
        start = time.perf_counter()
        llm = loaded["llm"] = programs.load_lm(model_path)
        module = type(llm).__module__
        expected = "genlm_fast." if impl == "genlm_fast" else "genlm.backend."
        if not module.startswith(expected):
            raise RuntimeError(f"the {impl} worker loaded {module}.{type(llm).__name__}")
        loaded["counter"] = _lm_counter(llm)
        return {
            "ready": True,
            "load_seconds": time.perf_counter() - start,
            "lm": f"{module}.{type(llm).__name__}",
        }

    loop = asyncio.new_event_loop()

    def run(request):
        llm, counter = loaded["llm"], loaded["counter"]
        sampler = StackSampler(loop=loop) if request.get("profile") else None
        calls = counter()
        begin = time.perf_counter()
        if sampler is not None:
            with sampler:
                outcome = loop.run_until_complete(
                    programs.run_program(request["program"], llm, request["seed"])
                )
        else:
            outcome = loop.run_until_complete(
                programs.run_program(request["program"], llm, request["seed"])
            )
        seconds = time.perf_counter() - begin
        done = counter()
        return {
            "seconds": seconds,
            "outcome": _outcome_json(outcome),
            "lm_calls": done[0] - calls[0],
            "lm_rows": done[1] - calls[1],
            "violations": programs.violations(outcome),
            "profile": sampler.shares() if sampler else None,
        }

    serve(run, first=load)
    # genlm-control leaves tasks of its own waiting (JSON-schema parsers): end them quietly
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:  # gather() of nothing would make its future on another loop
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()


class Workers:
    """One worker process per implementation, each with the model loaded.

    ``workers.run(impl, program, seed)`` runs a program there and returns the reply
    (raising RuntimeError with the worker's traceback if the program failed)."""

    def __init__(self, impls=IMPLS, model_path=None):
        self.procs = {}
        self.info = {}
        args = () if model_path is None else ("--model-path", model_path)
        for impl in impls:  # loading together: it is not timed
            self.procs[impl] = Worker(
                "bench.genlm_programs",
                impl,
                child_env(),
                python_args=("-W", "ignore"),
                args=args,
            )
        for impl in impls:
            self.info[impl] = self.procs[impl].receive("loading the model")

    def submit(self, impl, program, seed=0, profile=False):
        """Start a program in ``impl``'s worker; `receive` returns its reply. Workers of
        different implementations may run at once (for outcomes; timed runs go one by one)."""
        self.procs[impl].send({"program": program, "seed": seed, "profile": profile})

    def receive(self, impl, program):
        return self.procs[impl].receive(program)

    def run(self, impl, program, seed=0, profile=False):
        self.submit(impl, program, seed, profile)
        return self.receive(impl, program)

    def close(self):
        for worker in self.procs.values():
            worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- rounds, profile, report


def run_rounds(workers, programs, rounds, seed=0, log=None):
    """``{program: {impl: [reply, ...]}}``: ``rounds`` interleaved rounds."""
    impls = list(workers.procs)
    results = {p: {impl: [] for impl in impls} for p in programs}
    for r in range(rounds):
        order = impls if r % 2 == 0 else impls[::-1]
        for program in programs:
            for impl in order:
                reply = workers.run(impl, program, seed)
                results[program][impl].append(reply)
                if log:
                    log(
                        f"round {r + 1}/{rounds} {program:15s} {impl:10s} {reply['seconds']:7.2f} s"
                    )
    return results


def profile(workers, programs, seed=0):
    """``{program: {impl: shares}}`` from one sampled run each."""
    return {
        p: {impl: workers.run(impl, p, seed, profile=True)["profile"] for impl in workers.procs}
        for p in programs
    }


def best(replies):
    return min(r["seconds"] for r in replies)


def summary(results):
    """Per program: best seconds per implementation, the ratio, whether the particles
    matched in every round, constraint violations (there must be none)."""
    rows = []
    for program, by_impl in results.items():
        row = {"program": program}
        for impl, replies in by_impl.items():
            row[impl] = best(replies)
            row[f"{impl}_first"] = replies[0]["seconds"]
            row[f"{impl}_calls"] = f"{replies[0]['lm_calls']} / {replies[0]['lm_rows']}"
            row[f"{impl}_violations"] = sorted({v for r in replies for v in r["violations"]})
        if all(impl in by_impl for impl in IMPLS):
            row["speedup"] = row["genlm"] / row["genlm_fast"]
            pairs = zip(by_impl["genlm"], by_impl["genlm_fast"])
            row["same_particles"] = all(
                [p[0] for p in a["outcome"]["particles"]]
                == [p[0] for p in b["outcome"]["particles"]]
                for a, b in pairs
            )
        rows.append(row)
    return rows


def geomean(values):
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def report(rows, profiles=None, info=None, command=None) -> str:
    lines = ["# genlm-control's programs: genlm vs genlm_fast", ""]
    if info:
        lines += [f"- {k}: {v}" for k, v in info.items()] + [""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += [
        "Best of the interleaved rounds, wall seconds per program run (model loaded "
        "once per implementation, untimed; LM caches emptied and every random source "
        "seeded before each run). Goal: every program >= "
        f"{GOAL_EACH}x, geometric mean >= {GOAL_GEOMEAN}x.",
        "",
        "`first`: the program's first run in its worker (imports done before; "
        "one-time lazy set-up, such as packing weights or compiling kernels, included). "
        "`LM calls`: forwards / contexts run in one run (genlm_fast first).",
        "",
        "| program | genlm (s) | genlm_fast (s) | speedup | first: genlm / genlm_fast (s)"
        " | LM calls | same particles | constraints |",
        "|---|---:|---:|---:|---:|---:|:---:|---|",
    ]

    def cell(row, key, form="{:.2f}"):  # "-" for what a one-sided run has not
        return form.format(row[key]) if key in row else "-"

    for row in rows:
        bad = row.get("genlm_violations", []) + row.get("genlm_fast_violations", [])
        same = {True: "yes", False: "no", None: "-"}[row.get("same_particles")]
        lines.append(
            f"| {row['program']} | {cell(row, 'genlm')} | {cell(row, 'genlm_fast')} | "
            f"{cell(row, 'speedup', '{:.2f}x')} | "
            f"{cell(row, 'genlm_first')} / {cell(row, 'genlm_fast_first')} | "
            f"{cell(row, 'genlm_fast_calls', '{}')} vs {cell(row, 'genlm_calls', '{}')} | "
            f"{same} | {'held' if not bad else '; '.join(bad)[:200]} |"
        )
    speedups = [row["speedup"] for row in rows if "speedup" in row]
    if speedups:
        gm = geomean(speedups)
        met = all(s >= GOAL_EACH for s in speedups) and gm >= GOAL_GEOMEAN
        lines += [
            "",
            f"Geometric mean: {gm:.2f}x (goal {GOAL_GEOMEAN}x); slowest "
            f"{min(speedups):.2f}x (goal {GOAL_EACH}x): {'met' if met else 'NOT met'}.",
        ]
    if profiles:
        lines += [
            "",
            "## Where the time goes",
            "",
            "Share of one sampled run, applied to the best time (seconds): "
            "`LM forward` the forward pass (the model, and the backend code that "
            "builds its batch and stores its states), `LM backend` the rest of the LM "
            "layer (queueing, batching, output caches), `trie` the tries, `byte beam` "
            "the byte-level beam, `genlm-control` genlm-control and genlm-grammar's own "
            "Python, `waiting` the event loop blocked with nothing to run (until a "
            "timer, such as a batch's, runs out), "
            "`other` the rest (event loop, glue).",
            "",
            "| program | impl | " + " | ".join(PROFILE_COLUMNS) + " |",
            "|---|---|" + "---:|" * len(PROFILE_COLUMNS),
        ]
        by_name = {row["program"]: row for row in rows}
        for program, by_impl in profiles.items():
            for impl, shares in by_impl.items():
                total = by_name.get(program, {}).get(impl, float("nan"))
                cells = " | ".join(f"{shares[c] * total:.2f}" for c in PROFILE_COLUMNS)
                lines.append(f"| {program} | {impl} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["program"] for row in rows]
    x = range(len(names))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.38
    ax.bar([i - width / 2 for i in x], [row["genlm"] for row in rows], width, label="genlm")
    ax.bar(
        [i + width / 2 for i in x], [row["genlm_fast"] for row in rows], width, label="genlm_fast"
    )
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("seconds per run (best)")
    ax.legend()
    ax.set_title("genlm-control programs, SmolLM2-135M, CPU")
    ax2.bar(list(x), [row["speedup"] for row in rows], color="tab:green")
    ax2.axhline(GOAL_EACH, color="gray", ls="--", lw=1)
    ax2.set_xticks(list(x), names, rotation=30, ha="right")
    ax2.set_ylabel("speedup (genlm / genlm_fast)")
    ax2.set_title(f"geometric mean {geomean(r['speedup'] for r in rows):.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict:
    from bench.machine import dist_version, machine_info

    info = machine_info()
    info["genlm-control"] = dist_version("genlm-control")
    return info


def main(argv=None) -> int:
    from bench import programs as P

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--programs", nargs="+", choices=list(P.PROGRAMS), default=list(P.PROGRAMS))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (best is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--out", help="write the report here (and the plot beside it)")
    parser.add_argument(
        "--model",
        choices=("smollm2", "llama3.2-1b"),
        default="smollm2",
        help="SmolLM2-135M (float32), or the seeded Llama-3.2-1B architecture (bfloat16, as "
        "dtype='auto' loads it)",
    )
    parser.add_argument("--model-path", help=argparse.SUPPRESS)  # (the workers')
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model_path)
        return 0
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    path = None
    if args.model != "smollm2":
        from genlm_fast.models import llama3_path

        path = llama3_path(args.model, quiet=True)
    with Workers(args.impls, path) as workers:
        log(f"workers ready: {workers.info}")
        results = run_rounds(workers, args.programs, args.rounds, args.seed, log)
        profiles = None if args.no_profile else profile(workers, args.programs, args.seed)
    rows = summary(results)
    info = machine()
    info["rounds"] = args.rounds
    info["model"] = args.model
    text = report(rows, profiles, info, command_line("bench.genlm_programs", argv))
    if write_report(text, args.out) and len(args.impls) == len(IMPLS):
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    bad = [row for row in rows if row.get("genlm_violations") or row.get("genlm_fast_violations")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
