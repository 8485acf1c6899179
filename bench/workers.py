"""Worker processes of the benchmarks that compare genlm_fast with the real genlm packages.

Each implementation runs in a process of its own (``genlm_fast.dropin``'s import hook must
never meet the real packages): ``python -m bench.<module> --worker <name>``. Driver and
worker speak one JSON object a line: requests on the worker's stdin, replies on its stdout.
A reply that carries ``"error"`` (with ``"traceback"``) is a failure of the request;
`Worker.receive` raises it. The worker stops at the end of its stdin.

Worker side: `serve`. Driver side: `Worker`, `child_env`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra):
    """The environment of a worker (or a competing process): offline, this checkout
    importable, and ``extra``."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
        **extra,
    )


def serve(handle, first=None):
    """Answer the driver: ``handle(request)`` for each request on stdin, its reply (a dict)
    written back; an exception is replied as ``{"error", "traceback"}``. ``first``, when
    given, is called once before any request and its reply sent first (what the worker
    loaded, say); when it fails, the worker serves nothing. The replies go to a private copy
    of stdout: everything else written to stdout, by Python or by a library's own code,
    goes to stderr."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr

    def answer(call, *args):
        """Reply with ``call(*args)``; whether it succeeded."""
        try:
            reply = call(*args)
        except Exception as exc:  # noqa: BLE001 - reported to the driver
            reply = {
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:],
            }
        out.write(json.dumps(reply) + "\n")
        return "error" not in reply

    if first is not None and not answer(first):
        return
    for line in sys.stdin:
        answer(handle, json.loads(line))


class Worker:
    """One worker process, ``python -m <module> --worker <name>``, run from the checkout.

    Args:
        module (str): the benchmark module whose ``--worker`` runs `serve`.
        name (str): which implementation it hosts (its ``--worker`` argument).
        env (dict): its environment (`child_env`).
        log (file, optional): where its stderr goes (then quoted when it exits early);
            by default the driver's own stderr.
        python_args (list[str]): interpreter options before ``-m``.
        args (list[str]): the module's options after ``--worker <name>``.
    """

    def __init__(self, module, name, env, log=None, python_args=(), args=()):
        self.name = name
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, *python_args, "-m", module, "--worker", name, *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            bufsize=1,
        )

    def send(self, request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def receive(self, what=None):
        """The next reply; RuntimeError when it is an error (``what``: the request, named in
        the message) or when the worker exited."""
        line = self.proc.stdout.readline()
        if not line:
            status = self.proc.wait()
            if self.log is None:
                raise RuntimeError(f"the {self.name} worker exited (status {status}); see stderr")
            self.log.seek(0)
            raise RuntimeError(
                f"the {self.name} worker exited (status {status}):\n{self.log.read()[-4000:]}"
            )
        reply = json.loads(line)
        if "error" in reply:
            where = f"{what} failed on {self.name}" if what else f"{self.name} worker"
            raise RuntimeError(f"{where}: {reply['error']}\n{reply['traceback']}")
        return reply

    def ask(self, request, what=None):
        self.send(request)
        return self.receive(what)

    def close(self, timeout=60):
        """End the worker (its stdin closed: it stops after the request it is running)."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
