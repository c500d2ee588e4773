"""Running test cases on several spawned ranks (gloo on the CPU) and reporting them in pytest.

A multi-process test file defines its cases (``case(rank, world)`` functions that raise on failure),
a module-level ``_worker(rank, world, init_file, out_dir)`` that calls :func:`run_cases`, and a
module-scoped fixture that calls :func:`spawn_and_collect` once per world size; each test then
checks its case with :func:`check_case`. One group of processes runs every case of the file, so
the start-up cost (importing torch in each process) is paid once per world size.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import splitgrad


def run_cases(cases: dict, rank: int, world: int, init_file: str, out_dir: str, barrier: bool = True,
              backend: str = "gloo") -> None:
    """Runs every case on this rank and writes {case: traceback or None} to out_dir/rank{rank}.json.
    Deferred work a failed case left is run (or dropped) so it does not leak into the next case.
    With ``backend="nccl"`` rank r uses GPU r."""
    results = {}
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        for name, case in cases.items():
            try:
                case(rank, world)
                results[name] = None
            except BaseException:  # noqa: BLE001 - reported to the parent test
                results[name] = traceback.format_exc()
            finally:
                while splitgrad.pending_wgrads():
                    try:
                        splitgrad.backward_dw_all()
                    except RuntimeError:
                        pass
            if barrier:
                dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        results["__worker__"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def spawn_and_collect(worker, world: int, tmp, case_names, timeout_s: float) -> dict:
    """Starts ``world`` processes running ``worker``; returns {case: [traceback or None per rank]}."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(rank, world, str(tmp / "init"), str(tmp))) for rank in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    per_rank = []
    for rank, p in enumerate(procs):
        path = tmp / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} of {world} wrote no result (exit code {p.exitcode}"
                        f"{', killed after hanging' if rank in hung else ''})")
        per_rank.append(json.loads(path.read_text()))
    for rank, res in enumerate(per_rank):
        if "__worker__" in res:
            pytest.fail(f"rank {rank} of {world} failed outside the cases:\n{res['__worker__']}")
    return {case: [res.get(case, "case did not run") for res in per_rank] for case in case_names}


def check_case(results: dict, case: str) -> None:
    """Fails the test with every rank's traceback if the case failed on any rank."""
    failures = [(rank, tb) for rank, tb in enumerate(results[case]) if tb is not None]
    if failures:
        pytest.fail("\n".join(f"--- rank {rank} of {len(results[case])}:\n{tb}" for rank, tb in failures),
                    pytrace=False)
