"""Contention benchmark: genlm_fast and the references idle, beside a busy loop, and beside
another process's 2-thread torch matmuls.

    flock /tmp/genlm_cpu.lock python -m bench.contention [--quick] [--out FILE]
    python -m bench.contention --workloads trie-sum-B1,lm-step --seconds 2

Workloads (each: genlm_fast, and the reference on the same inputs):

* ``trie-sum-B1``, ``trie-sum-B32``: ``batch_weight_sum`` on the Llama-3 vocabulary (128,256
  tokens) at B=1 and B=32: genlm_fast's ``ParallelTokenCharacterTrie`` (float32) against
  genlm-backend's numba ``TokenCharacterTrie``, both fed the same probabilities.
* ``lm-step``: one 16-row step of ``AsyncTransformer`` on SmolLM2-135M-Instruct, as SMC drives
  it: 16 concurrent ``next_token_logprobs`` calls, auto-batched into one forward (default
  batching settings: genlm-backend's batch waits its 20 ms timeout, genlm_fast's runs when
  the event loop idles), for contexts whose prompts were evaluated before, each extended by 3
  fresh random tokens (no output-cache hits; genlm_fast reuses the prompts' key/value states,
  genlm-backend runs the whole contexts).
* ``beam``: the byte-level beam (K=5) on SmolLM2: prefill a 10-byte prompt, then 5 bytes with
  ``logp_next`` before each; cold LM caches (built, untimed, before each call);
  genlm_fast.bytes against genlm-bytes on genlm-backend.
* ``control``: one genlm-control program (a small one of this module's own: ``PromptedLLM``
  constrained by a regular expression through ``BoolFSA``, the AWRS sampler, SMC with 8
  particles and at most 8 tokens, cold caches, fixed seeds), on genlm_fast through
  ``genlm_fast.dropin`` and on the real genlm-backend.

Each implementation runs in a worker process of its own (the drop-in's import hook must not
meet the real packages), hosting all its workloads; the driver alternates the two workers in
blocks of about ``--block`` seconds (at least one call each), 0.25 s apart, until each has
run ``--seconds`` and ``--min-calls`` calls, for every (condition, workload). Conditions:
``idle``; ``idle-1t`` (idle, each worker's torch threads, and so the kernels' teams, set to
1: what losing a CPU alone costs, for comparison); ``busy-loop`` (a process running
``while True: pass``); ``torch-2t`` (a process multiplying 512 x 512 float32 matrices on 2
torch threads, with torch's default OpenMP settings); ``lm-program`` (another genlm_fast
program: SmolLM2 decoding 8 rows a step with a 2 ms pause between steps, so that the CPUs it
leaves free come and go within a second). Each competitor starts 1 s before the
condition's first block (``lm-program``: 1 s after its first step). The figure is the mean
time per call (what a program sees: a call that waited for a CPU counts in full; medians are
saved too), and the slowdown factor is a condition's mean over the idle one. The goals:
genlm_fast's factor under each competitor no worse than the reference's, and at most 2.5
beside the busy loop.

Run it alone on the machine (the shared lock): the competitors are its own. The table, the
machine (CPU, usable CPUs, load), the environment's OpenMP settings and the commit go to
``--out`` (default ``bench/results/contention-<date>.md``) and a JSON beside it (the table's
figures, and each series' 10th and 90th percentiles and maximum).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.programs import seed_everything  # noqa: E402 (after the checkout's path)
from bench.report import command_line, write_report  # noqa: E402
from bench.workers import Worker, child_env, serve  # noqa: E402

WORKLOADS = ("trie-sum-B1", "trie-sum-B32", "lm-step", "beam", "control")
CONDITIONS = ("idle", "idle-1t", "busy-loop", "torch-2t", "lm-program")
SIDES = ("genlm_fast", "reference")
BUSY_LOOP_GOAL = 2.5
# pause before each block: the other side's work is over (its threads asleep, genlm_fast's
# contention reading past it), so that "idle" is an idle machine for both
SETTLE_S = 0.25

_TORCH_COMPETITOR = """
import torch
torch.set_num_threads(2)
a = torch.randn(512, 512)
while True:
    a @ a
"""
# another genlm_fast program on the machine: SmolLM2 decoding 8 rows a step, with a short
# pause for host work between steps, so that it takes the CPUs in bursts (its forwards
# follow the contention they see, as ours do); prints "ready" once its model is loaded
_LM_COMPETITOR = """
import asyncio, random, time
from genlm_fast.backend.llm import AsyncTransformer
from genlm_fast.models import smollm2_path
lm = AsyncTransformer.from_name(smollm2_path())
prompt = lm.tokenizer.encode("Another experiment on the same machine:")
rng = random.Random(0)
async def main():
    contexts, steps = [], 0
    while True:
        if not contexts or len(contexts[0]) >= len(prompt) + 48:
            contexts = [list(prompt) for _ in range(8)]
        contexts = [c + [rng.randrange(1000, 20000)] for c in contexts]
        await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        steps += 1
        if steps == 1:
            print("ready", flush=True)
        time.sleep(0.002)
asyncio.run(main())
"""
COMPETITORS = {
    "idle": None,
    "idle-1t": None,
    "busy-loop": ["-c", "while True: pass"],
    "torch-2t": ["-c", _TORCH_COMPETITOR],
    "lm-program": ["-c", _LM_COMPETITOR],
}
# competitors that say "ready" on their first line of output when their work has begun
ANNOUNCING = ("lm-program",)

# exit status of a run that finished with a goal not met: its finding, told apart from a
# failure to run (an uncaught exception exits with 1)
GOALS_NOT_MET = 3

# --------------------------------------------------------------------------- workloads

LM_ROWS = 16
LM_NEW_TOKENS = 3
BEAM_PROMPT = b"The sky is"
BEAM_BYTES = b" blue"
BEAM_K = 5
CONTROL_PROMPT = "Write a short sentence about the sea:"
CONTROL_REGEX = r"( [a-z]+)+\."
CONTROL_PARTICLES = 8
CONTROL_TOKENS = 8
SEED = 1234


class Workload:
    """``start`` runs (untimed) before each block of calls, ``prepare`` before each call;
    ``call`` is the timed unit of work."""

    def start(self):
        pass

    def prepare(self):
        pass

    def call(self):
        raise NotImplementedError


class TrieSum(Workload):
    def __init__(self, side, batch):
        from bench import kernels as K
        from bench.vocabs import load_vocab

        _, vocab = load_vocab("llama3")
        if side == "genlm_fast":
            trie = K.build_fast(vocab, "parallel")
        else:
            trie = K.build_reference(K.ref_tokens(vocab), "numba")
        _, self.probs = K.make_inputs(len(vocab), batch)
        self.fn = trie.batch_weight_sum
        self.trie = trie

    def call(self):
        self.fn(self.probs)


class Models:
    """One SmolLM2 per worker, shared by the LM workloads, and the worker's event loop."""

    def __init__(self, side):
        from genlm_fast.models import smollm2_path

        self.side = side
        self.path = smollm2_path()
        self.loop = asyncio.new_event_loop()
        self._lm = None

    @property
    def lm(self):
        if self._lm is None:
            if self.side == "genlm_fast":
                from genlm_fast.backend.llm import AsyncTransformer

                self._lm = AsyncTransformer.from_name(self.path)
            else:
                from genlm.backend import llm
                from transformers import AutoModelForCausalLM, AutoTokenizer

                # genlm-backend's from_name, spelled out for a local directory
                tok = AutoTokenizer.from_pretrained(self.path)
                model = AutoModelForCausalLM.from_pretrained(self.path, dtype="auto")
                self._lm = llm.AsyncTransformer(model, tok)
        return self._lm

    def run(self, coro):
        return self.loop.run_until_complete(coro)


class LMStep(Workload):
    def __init__(self, models):
        self.models = models
        self.lm = models.lm
        tok = self.lm.tokenizer
        self.prompts = [tok.encode(f"Note {i}: the weather today is") for i in range(LM_ROWS)]
        self.rng = random.Random(SEED)

    def start(self):
        # the prompts evaluated (genlm_fast keeps their key/value states)
        self.lm.clear_cache()
        self.lm.batch_next_token_logprobs_sync(self.prompts)

    def prepare(self):
        self.contexts = [
            p + [self.rng.randrange(1000, 40000) for _ in range(LM_NEW_TOKENS)]
            for p in self.prompts
        ]

    def call(self):
        async def step(contexts):
            return await asyncio.gather(*(self.lm.next_token_logprobs(c) for c in contexts))

        self.models.run(step(self.contexts))


class Beam(Workload):
    def __init__(self, models, side):
        self.models = models
        lm = models.lm
        if side == "genlm_fast":
            from genlm_fast.bytes import BeamParams, ByteBeamState

            params = BeamParams(K=BEAM_K)

            async def make_beam():
                return await ByteBeamState.initial(lm, params)
        else:
            import warnings

            import genlm.bytes as ref_bytes
            from genlm.bytes.trie import TrieMode

            params = ref_bytes.BeamParams(K=BEAM_K)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trie = ref_bytes.AsyncTokenByteTrie.from_vocab(
                    lm.byte_vocab, eos_byte_strings=params.eos_byte_strings, device="cpu"
                )

            async def make_beam():
                state = ref_bytes.LazyTrieState.initial(lm, trie, mode=TrieMode.WITH_EOS)
                return ref_bytes.ByteBeamState([await state.materialize()], params)

        self.make_beam = make_beam

    def prepare(self):
        self.models.lm.clear_cache()
        self.beam = self.models.run(self.make_beam())

    def call(self):
        async def run(beam):
            beam = await beam.prefill(BEAM_PROMPT)
            for b in BEAM_BYTES:
                await beam.logp_next()
                beam = await (beam.prune() << b)
            return await beam.logp_next()

        self.models.run(run(self.beam))


class Control(Workload):
    """A small genlm-control program: SMC over a regular-expression-constrained LM."""

    def __init__(self, models):
        from genlm.control import AWRS, BoolFSA, PromptedLLM

        self.models = models
        potential = PromptedLLM(models.lm)
        potential.set_prompt_from_str(CONTROL_PROMPT)
        fsa = BoolFSA.from_regex(CONTROL_REGEX)
        self.sampler = AWRS(potential, fsa.coerce(potential, f=b"".join))

    def prepare(self):
        self.models.lm.clear_cache()
        seed_everything(SEED)

    def call(self):
        self.models.run(
            self.sampler.smc(
                n_particles=CONTROL_PARTICLES,
                ess_threshold=0.5,
                max_tokens=CONTROL_TOKENS,
                verbosity=0,
            )
        )


def _build(name, side, models):
    if name.startswith("trie-sum-B"):
        return TrieSum(side, int(name.removeprefix("trie-sum-B")))
    if name == "lm-step":
        return LMStep(models)
    if name == "beam":
        return Beam(models, side)
    if name == "control":
        return Control(models)
    raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def _block(work, seconds, min_calls):
    """Calls of ``work`` until ``seconds`` of them ran and at least ``min_calls``; their
    times."""
    work.start()
    times = []
    while len(times) < min_calls or sum(times) < seconds:
        work.prepare()
        t = time.perf_counter()
        work.call()
        times.append(time.perf_counter() - t)
    return times


def worker(side):
    """Serve the driver (`bench.workers.serve`): ``setup`` builds and warms the workloads,
    ``block`` runs one block of calls and returns their times."""
    import warnings

    warnings.simplefilter("ignore")
    if side == "genlm_fast":
        import genlm_fast.dropin  # noqa: F401  (genlm-control's genlm imports -> genlm_fast)
    models = Models(side)
    works = {}

    def handle(msg):
        if msg["cmd"] == "setup":
            for name in msg["workloads"]:
                works[name] = _build(name, side, models)
                _block(works[name], 0.0, 1)  # warm-up
            return {"info": _threads_info()}
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(msg.get("threads") or threads)
        try:
            times = _block(works[msg["workload"]], msg["seconds"], msg["min_calls"])
            info = _threads_info()  # what the block ran with
        finally:
            torch.set_num_threads(threads)
        return {"times": times, "info": info}

    serve(handle)


def _threads_info():
    import torch

    from genlm_fast.backend.llm.threads import threads_info

    info = threads_info() or {}
    info["torch_threads"] = torch.get_num_threads()
    return info


# --------------------------------------------------------------------------- driver


def _child_env():
    """The environment of the workers and competitors (`bench.workers.child_env`)."""
    return child_env(TOKENIZERS_PARALLELISM="false")


class Competitor:
    def __init__(self, condition):
        args = COMPETITORS[condition]
        self.condition = condition
        self.announces = condition in ANNOUNCING
        self.proc = (
            None
            if args is None
            else subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if self.announces else subprocess.DEVNULL,
                text=True,
            )
        )

    def __enter__(self):
        if self.proc is not None:
            if self.announces and self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError(
                    f"the {self.condition} competitor exited (status {self.proc.wait()})"
                )
            time.sleep(1.0)
        return self

    def cpu_seconds(self):
        """CPU time the competitor has used so far (user + system, of the process and the
        children it waited for), from /proc: evidence that it ran, whatever else did."""
        if self.proc is None:
            return 0.0
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            time.sleep(0.5)  # its CPU time leaves the others' readings of the next condition


def run(
    workloads=WORKLOADS,
    conditions=CONDITIONS,
    seconds=2.0,
    block=0.4,
    min_calls=2,
    fast_threads=None,
    log=print,
):
    """``{condition: {workload: {side: [seconds per call]}}}``, the workers' thread
    readings, and ``{condition: {"cpu_seconds", "wall_seconds"}}``: the competitor's own CPU
    time over the condition (0 where there is none). ``fast_threads``: genlm_fast's torch
    threads (and so its kernels' teams) in every condition, instead of its own choice."""
    results = {c: {w: {s: [] for s in SIDES} for w in workloads} for c in conditions}
    readings = {c: {} for c in conditions}
    competitors = {}  # condition -> the competitor's CPU seconds over the condition's
    with tempfile.TemporaryDirectory() as logs:
        workers = {}
        try:
            for side in SIDES:
                worker_log = open(Path(logs) / f"worker-{side}.log", "w+")  # noqa: SIM115
                workers[side] = Worker("bench.contention", side, _child_env(), worker_log)
            for side in SIDES:
                log(f"setting up {side}: {', '.join(workloads)} ...")
                workers[side].ask({"cmd": "setup", "workloads": list(workloads)})
            for condition in conditions:
                with Competitor(condition) as competitor:
                    begun = time.perf_counter()
                    for name in workloads:
                        done = results[condition][name]
                        while any(
                            len(done[s]) < min_calls or sum(done[s]) < seconds for s in SIDES
                        ):
                            for side in SIDES:
                                threads = fast_threads if side == "genlm_fast" else None
                                time.sleep(SETTLE_S)
                                answer = workers[side].ask(
                                    {
                                        "cmd": "block",
                                        "workload": name,
                                        "seconds": block,
                                        "min_calls": 1,
                                        "threads": 1 if condition == "idle-1t" else threads,
                                    }
                                )
                                done[side] += answer["times"]
                                if side == "genlm_fast":
                                    readings[condition][name] = answer["info"]
                        log(
                            f"{condition:>9} {name:>13}: "
                            + ", ".join(
                                f"{s} {1e3 * statistics.mean(done[s]):.2f} ms ({len(done[s])})"
                                for s in SIDES
                            )
                        )
                    competitors[condition] = {
                        "cpu_seconds": competitor.cpu_seconds(),
                        "wall_seconds": time.perf_counter() - begun,
                    }
        finally:
            for w in workers.values():
                w.close()
                w.log.close()
    return results, readings, competitors


def summary(results):
    """Rows of (workload, side, {condition: (mean ms, median ms, calls, factor)})."""
    rows = []
    conditions = list(results)
    for name in next(iter(results.values())):
        for side in SIDES:
            cells = {}
            idle = None
            for c in conditions:
                ts = results[c][name][side]
                mean = 1e3 * statistics.mean(ts)
                idle = mean if c == "idle" else idle
                cells[c] = {
                    "mean_ms": mean,
                    "median_ms": 1e3 * statistics.median(ts),
                    "calls": len(ts),
                    "factor": None if idle is None else mean / idle,
                }
            rows.append({"workload": name, "side": side, "cells": cells})
    return rows


def _quantile_ms(ts, q):
    """The ``q`` quantile of sorted times ``ts``, in ms."""
    return round(1e3 * ts[min(len(ts) - 1, int(q * len(ts)))], 3)


def spread(results):
    """{condition: {workload: {side: {p10, p90, max ms}}}}: how the calls' times spread."""
    out = {}
    for c, per in results.items():
        for name, sides in per.items():
            for side, ts in sides.items():
                ts = sorted(ts)
                out.setdefault(c, {}).setdefault(name, {})[side] = {
                    "p10_ms": _quantile_ms(ts, 0.1),
                    "p90_ms": _quantile_ms(ts, 0.9),
                    "max_ms": round(1e3 * ts[-1], 3),
                }
    return out


def goals(rows):
    """(text, met) per (workload, competitor)."""
    out = []
    by = {(r["workload"], r["side"]): r["cells"] for r in rows}
    for name in dict.fromkeys(r["workload"] for r in rows):
        fast, ref = by[name, "genlm_fast"], by[name, "reference"]
        for c in fast:
            if c.startswith("idle") or fast[c]["factor"] is None:
                continue
            f, g = fast[c]["factor"], ref[c]["factor"]
            met = f <= g
            text = f"{name}, {c}: genlm_fast {f:.2f}x vs reference {g:.2f}x"
            if c == "busy-loop":
                met = met and f <= BUSY_LOOP_GOAL
                text += f" (and <= {BUSY_LOOP_GOAL}x)"
            if "idle-1t" in fast:  # what the lost CPU alone explains
                one = fast[c]["mean_ms"] / fast["idle-1t"]["mean_ms"]
                text += f"; genlm_fast beside it: {one:.2f}x its idle time on one thread"
            out.append((text, met))
    return out


def table(rows, info, readings, command):
    conditions = list(rows[0]["cells"])
    lines = ["# genlm_fast under contention", "", f"`{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += [
        "",
        "Mean ms per call (median in brackets), and the slowdown factor over idle:",
        "",
        "| workload | implementation | " + " | ".join(conditions) + " |",
        "|---|---|" + "---|" * len(conditions),
    ]
    for r in rows:
        cells = []
        for c in conditions:
            cell = r["cells"][c]
            text = f"{cell['mean_ms']:.2f} ({cell['median_ms']:.2f})"
            if c != "idle":
                text += f", **{cell['factor']:.2f}x**"
            cells.append(text)
        label = "genlm_fast" if r["side"] == "genlm_fast" else _reference_name(r["workload"])
        lines.append(f"| {r['workload']} | {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Speedup of genlm_fast over the reference (mean times):",
        "",
        "| workload | " + " | ".join(conditions) + " |",
        "|---|" + "---|" * len(conditions),
    ]
    by = {(r["workload"], r["side"]): r["cells"] for r in rows}
    for name in dict.fromkeys(r["workload"] for r in rows):
        lines.append(
            f"| {name} | "
            + " | ".join(
                f"{by[name, 'reference'][c]['mean_ms'] / by[name, 'genlm_fast'][c]['mean_ms']:.1f}x"
                for c in conditions
            )
            + " |"
        )
    lines += [
        "",
        (
            "Goals (slowdown no worse than the reference's; at most "
            f"{BUSY_LOOP_GOAL}x beside the busy loop):"
        ),
        "",
    ]
    lines += [f"- {'met' if met else 'NOT met'}: {text}" for text, met in goals(rows)]
    lines += [
        "",
        (
            "genlm_fast's thread readings at the end of each condition (CPUs other "
            "work kept busy, and the team size it allowed):"
        ),
        "",
    ]
    for c, per in readings.items():
        if per:
            last = list(per.values())[-1]
            lines.append(
                f"- {c}: others_busy {last.get('others_busy', 0):.2f}, free_cpus "
                f"{last.get('free_cpus')}, usable_cpus {last.get('usable_cpus')}, "
                f"torch threads {last.get('torch_threads')}"
            )
    return "\n".join(lines) + "\n"


def _reference_name(workload):
    if workload.startswith("trie"):
        return "genlm-backend numba"
    if workload == "beam":
        return "genlm-bytes"
    if workload == "control":
        return "genlm-control on genlm-backend"
    return "genlm-backend"


def machine_info():
    from bench import machine
    from genlm_fast.backend.llm.threads import threads_info

    info = machine.machine_info()
    t = threads_info()
    if t is not None:
        info["usable CPUs (affinity / cgroup quota)"] = (
            f"{t['usable_cpus']} ({t['affinity_cpus']} / {t['quota_cpus'] or 'none'})"
        )
    for k in ("numba", "genlm_fast cpu backends"):
        info.pop(k, None)
    info["genlm-control"] = machine.dist_version("genlm-control")
    return info


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.contention", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)",
    )
    parser.add_argument(
        "--conditions",
        default=",".join(CONDITIONS),
        help=f"comma-separated, of {', '.join(CONDITIONS)} (default: all; "
        "idle is needed for the factors)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="time per implementation, workload and condition (default 2)",
    )
    parser.add_argument(
        "--block",
        type=float,
        default=0.5,
        help="seconds per block before the other implementation runs",
    )
    parser.add_argument("--min-calls", type=int, default=2, help="calls at least (default 2)")
    parser.add_argument(
        "--fast-threads",
        type=int,
        default=None,
        help="genlm_fast's torch threads in every condition (default: its own choice); "
        "--fast-threads 1 asks what a single-threaded genlm_fast would keep",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="--seconds 1 --min-calls 1 (about half the time; the slow "
        "references' factors then rest on one call)",
    )
    parser.add_argument(
        "--out", default=None, help="markdown output (default bench/results/contention-<date>.md)"
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.quick:
        args.seconds, args.min_calls = 1.0, 1
    workloads = [w for w in args.workloads.split(",") if w]
    conditions = [c for c in args.conditions.split(",") if c]
    for c in conditions:
        if c not in COMPETITORS:
            parser.error(f"unknown condition {c!r}")
    if "idle" not in conditions:
        parser.error("the conditions must include idle (the factors are over it)")
    conditions = ["idle"] + [c for c in conditions if c != "idle"]
    if args.fast_threads is not None and args.fast_threads < 1:
        parser.error("--fast-threads must be at least 1")
    started = time.perf_counter()
    info = machine_info()
    if args.fast_threads is not None:
        info["genlm_fast's torch threads"] = f"{args.fast_threads} in every condition"
    results, readings, competitors = run(
        workloads, conditions, args.seconds, args.block, args.min_calls, args.fast_threads
    )
    info["load average at end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    info["run time"] = f"{time.perf_counter() - started:.0f} s"
    rows = summary(results)
    text = table(rows, info, readings, command_line("bench.contention", argv))
    print()
    out = write_report(text, args.out, "contention")
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "info": info,
                "rows": rows,
                "readings": readings,
                "competitors": competitors,
                "spread": spread(results),
            },
            indent=1,
        )
    )
    print(f"wrote {out} and {out.with_suffix('.json').name}")
    return 0 if all(met for _, met in goals(rows)) else GOALS_NOT_MET


if __name__ == "__main__":
    sys.exit(main())
