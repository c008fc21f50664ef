"""Where a prepare's time goes: ``python -m bench.profile_prepare [--runs N] [--batch N]``.

A real ``tessera run --simulate`` daemon on the benchmark's 64-GPU node (bench/prepare.py) runs
under py-spy (sampling at 1 kHz, every thread); the kubelet client prepares and unprepares
``--batch`` claims ``--runs`` times. The samples taken in the agent's prepare threads are
summed by what they were doing (a thread waiting for work or for another thread is not
counted), each sample once, in the first bucket that matches its stack from the innermost frame
out:

- durable writes: ``atomic_write`` (file fsync, rename, directory fsync) and ``fsync_dir``;
- checkpoint encoding: ``checkpoint.encode`` (canonical JSON, checksum);
- CDI spec building: ``CdiWriter`` building a claim's spec (and the schema check, if any);
- claim read and plan: ``parse_allocation``, ``plan_claim``, the claim source;
- locks, logging, thread hand-offs and the rest: everything else.

py-spy must be installed (it is in the test extra); it needs ptrace rights over the daemon
(root, or ``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import sys
from pathlib import Path

import yaml

from bench.common import Daemon, claim, scratch
from bench.prepare import GPUS, NODE, model_64
from dra_driver.testkubelet.client import KubeletClient

BUCKETS = (
    ("durable writes (fsync, rename, directory fsync)", ("atomic_write", "fsync_dir")),
    ("checkpoint encoding", ("encode (dra_driver/kubeletplugin/checkpoint.py",)),
    ("CDI spec building", ("CdiWriter._claim_spec", "CdiWriter.build_spec", "validate_spec")),
    ("claim read and plan", ("parse_allocation", "plan_claim", "ClaimSource", ".get (dra")),
)
WORKER_THREADS = ("prepare", "unprepare")
IDLE = ("_worker (concurrent/futures/thread.py", "Condition.wait ", "Event.wait ")
"""Innermost frames of a thread that waits (py-spy counts a pool worker blocked on its queue
as active): a pool thread with nothing to do, a batch waiting for its claims' steps."""


def classify(stack: list[str]) -> str:
    for frame in reversed(stack):
        for name, needles in BUCKETS:
            if any(n in frame for n in needles):
                return name
    return "locks, logging, hand-offs, other"


def summarize(raw: Path, op: str) -> tuple[int, dict[str, int]]:
    """(samples, samples per bucket) of the threads of ``op`` (prepare or unprepare)."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack_text, _, n = line.rpartition(" ")
        frames = stack_text.split(";")
        thread = frames[0]
        if f": {op}" not in thread or (op == "prepare" and ": unprepare" in thread):
            continue
        if any(frames[-1].startswith(idle) for idle in IDLE):
            continue
        counts[classify(frames[1:])] += int(n)
    return sum(counts.values()), dict(counts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_prepare")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--batch", type=int, default=1, choices=range(1, GPUS + 1))
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy is not installed: pip install py-spy (it is in the test extra)")
        return 2
    with scratch("tpp-") as tmp:
        model_file = tmp / f"{NODE}.yaml"
        model_file.write_text(yaml.safe_dump(model_64()))
        claims = [claim(f"c{i}", f"gpu-{i}") for i in range(args.batch)]
        raw = tmp / "profile.txt"
        record = [spy, "record", "-r", "1000", "-f", "raw", "-o", str(raw), "--threads", "--"]
        daemon = Daemon(tmp, str(model_file), NODE, claims, wrap=record)
        refs = [c.ref for c in claims]
        with KubeletClient(daemon.socket) as k:
            for _ in range(args.runs):
                k.prepare(refs)
                k.unprepare(refs)
        daemon.proc.send_signal(signal.SIGINT)  # py-spy stops the daemon and writes its file
        daemon.proc.wait(120)
        daemon.stop(unprepare=False)
        for op in WORKER_THREADS:
            total, buckets = summarize(raw, op)
            print(f"\n{op}: {total} samples at 1 kHz in its threads, {args.runs} calls of"
                  f" {args.batch} claim(s): {total / args.runs:.2f} ms per call")  # fmt: skip
            for name, n in sorted(buckets.items(), key=lambda kv: -kv[1]):
                print(f"  {n / max(total, 1) * 100:5.1f} %  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
