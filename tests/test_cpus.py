"""launch/cpus.py: the host's CPUs shared out among points side by side (hydra/launcher=gpu_pool),
near their GPUs, hyperthreads together; a point's job pins itself and torch sizes its threads by it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from launch import cpus
from launch.gpu_pool import GpuPool, QueuedPoint, packed


def test_blocks_are_contiguous_even_and_disjoint_and_wrap_when_cpus_run_short():
    assert cpus.blocks(list(range(10)), 4) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    assert cpus.blocks([4, 5], 1) == [[4, 5]]
    assert cpus.blocks([0, 1], 3) == [[0], [1], [0]]  # more points than CPUs: they share, in turn


def test_a_cores_hyperthreads_stay_in_one_block(tmp_path):
    # 2 cores x 2 threads, Linux's numbering: 0 and 2 are core 0's threads, 1 and 3 core 1's
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    order = cpus.by_core(range(4), sysfs=tmp_path)
    assert order == [0, 2, 1, 3]
    assert cpus.blocks(order, 2) == [[0, 2], [1, 3]]  # each point a whole core, not half of two
    assert cpus.by_core([5, 4], sysfs=tmp_path) == [4, 5]  # sysfs silent: numeric order


def test_gpus_share_the_cpus_near_them_and_every_slot_gets_its_own():
    near = {0: set(range(8)), 1: set(range(8)), 2: set(range(8, 16)), 3: set(range(8, 16))}
    seats = cpus.plan([0, 1, 2, 3], 2, list(range(16)), near)
    assert set(seats) == {(g, s) for g in range(4) for s in range(2)}
    assert all(len(c) == 2 for c in seats.values())
    assert all(set(seats[g, s]) <= near[g] for g, s in seats)  # a GPU's points on its NUMA node's CPUs
    every = [c for cs in seats.values() for c in cs]
    assert sorted(every) == list(range(16))  # each CPU to one slot only
    # NVML silent about a GPU (or no NVML): the GPUs share every CPU this process may use
    assert cpus.plan([0, 1], 1, [0, 1, 2, 3], {}) == {(0, 0): [0, 1], (1, 0): [2, 3]}
    # near CPUs outside the allowed ones (a SLURM allocation on the other socket): the allowed ones
    assert cpus.plan([0], 1, [12, 13], {0: {0, 1}}) == {(0, 0): [12, 13]}


def test_cpu_lists_read_and_write_tasksets_form():
    assert cpus.fmt([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert cpus.parse("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpus.fmt([]) == "" and cpus.parse("") == []


def test_points_running_at_once_hold_cpus_no_other_running_point_holds():
    seats = cpus.plan([0, 1], 2, list(range(8)))
    points = [QueuedPoint(i, [], w, True, str(i), None) for i, w in enumerate([1, 2, 1, 1, 2, 1])]
    held: dict[int, set[int]] = {}
    overlaps = []

    class Job:
        def __init__(self, idx):
            self.idx, self.polls = idx, 2

        def done(self):
            self.polls -= 1
            return self.polls < 0

    def start(point, lease):
        mine = set(lease.cpus)
        assert len(mine) == 2 * len(lease.ids)  # two CPUs a slot, a slot on each of its GPUs
        overlaps.extend(i for i, other in held.items() if other & mine)
        held[point.idx] = mine
        return Job(point.idx)

    for point, _, _ in packed(points, [0, 1], start, Job.done, lambda job: None, poll_s=0, per_gpu=2, cpus=seats):
        del held[point.idx]
    assert not overlaps and not held


def test_a_pool_without_a_plan_lends_no_cpus():
    assert GpuPool([0]).take(1).cpus == ()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux's affinity calls")
def test_a_job_given_cpus_pins_itself_and_torch_and_its_children_follow():
    mine = cpus.allowed()[:1]
    code = ("import json, os, subprocess, sys, torch; from launch import cpus; cpus.pin_from_env(); "
            "child = subprocess.run([sys.executable, '-c', 'import os, torch; print(len(os.sched_getaffinity(0)), "
            "torch.get_num_threads())'], capture_output=True, text=True).stdout.split(); "
            "print(json.dumps([sorted(os.sched_getaffinity(0)), child]))")
    env = {**os.environ, cpus.ENV: cpus.fmt(mine), "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    pinned, child = json.loads(out.stdout)
    assert pinned == mine and child == ["1", "1"]  # the worker it starts: one CPU, one thread
    env[cpus.ENV] = "100000"  # a CPU this process may not use: left as it was, no error
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and json.loads(out.stdout)[0] == cpus.allowed(), out.stderr[-2000:]
