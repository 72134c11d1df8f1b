"""Settings that must be made before JAX starts (glibc's malloc, XLA's flags), compared in
worker processes: one per setting, each building its steps once and saying so, then asked
for one step at a time, the settings in alternating order, so that each repetition is a pair.

The worker is `python -m tools.benchmark ARGS FLAG SETTING`: it writes one JSON line when its
steps are compiled (with whatever it measured of them), then answers each phase name read
from stdin with a JSON line of that step's seconds, page faults and CPU seconds."""

from __future__ import annotations

import json
import subprocess
import sys


class Workers:
    """The worker processes by setting, each run with its own environment; `ready[setting]`
    is its first line. Use it as a context manager: on leaving, a worker still running is
    killed."""

    def __init__(self, args: list[str], flag: str, envs: dict[str, dict[str, str]], label: str):
        self.cmd, self.flag, self.label = [sys.executable, "-m", "tools.benchmark", *args], flag, label
        self.procs = {s: subprocess.Popen([*self.cmd, flag, s], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          text=True, env=env) for s, env in envs.items()}
        self.ready = {}

    def __enter__(self) -> Workers:
        for s in self.procs:
            line = self.ask(s)
            if not line.get("ready"):
                raise RuntimeError(f"the {self.flag} worker ({s}) wrote {line} before it was ready")
            self.ready[s] = line
        return self

    def __exit__(self, *exc) -> None:
        for w in self.procs.values():
            if w.poll() is None:
                w.kill()
                w.wait()

    def ask(self, setting: str, phase: str | None = None) -> dict:
        """The worker's next line, after sending it `phase` (None: send nothing)."""
        w = self.procs[setting]
        try:
            if phase is not None:
                w.stdin.write(phase + "\n")
                w.stdin.flush()
            line = w.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise RuntimeError(f"the {self.flag} worker ({setting}) for {self.label} exited; run it alone to see "
                               "why: " + " ".join([*self.cmd, self.flag, setting]))
        return json.loads(line)

    def close(self) -> None:
        """End every worker (stdin closed) and check that each exited cleanly."""
        for w in self.procs.values():
            w.stdin.close()
            if w.wait(timeout=120) != 0:
                raise RuntimeError(f"a {self.flag} worker for {self.label} exited with {w.returncode}")


def paired_steps(workers: Workers, phases, reps: int, phase_major: bool = True) -> dict:
    """{(setting, phase): [each repetition's answer]} over `reps` repetitions after one that
    warms up; the settings alternate which goes first. `phase_major`: each phase runs under
    every setting before the next phase; else each setting runs every phase in turn."""
    settings = list(workers.procs)
    got = {(s, p): [] for s in settings for p in phases}
    for rep in range(reps + 1):
        order = settings[::-1] if rep % 2 else settings
        pairs = ([(s, p) for p in phases for s in order] if phase_major else
                 [(s, p) for s in order for p in phases])
        for s, p in pairs:
            answer = workers.ask(s, p)
            if rep:
                got[(s, p)].append(answer)
    return got


def serve(run, ready: dict) -> None:
    """The worker's side: `ready` as its first line, then `run(phase)` for each line of stdin."""
    print(json.dumps({"ready": True, **ready}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(line.strip())), flush=True)


def measured_step(state_and_step: list, placed, t_end: int | None = None) -> dict:
    """One step (`steps.time_step`; with `t_end`, the one ending there, its counter set
    first) with its seconds, minor page faults and user and system CPU seconds."""
    import resource

    from tools.bench import steps

    if t_end is not None:
        state_and_step[0] = steps.ending_at(state_and_step[0], t_end)
    before = resource.getrusage(resource.RUSAGE_SELF)
    seconds = steps.time_step(state_and_step, placed)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"s": seconds, "faults": after.ru_minflt - before.ru_minflt, "sys_s": after.ru_stime - before.ru_stime,
            "user_s": after.ru_utime - before.ru_utime}
