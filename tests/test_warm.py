"""Workers started ahead of their launch (launch/warm_start.py): a server that imported while the
job, or the point before, worked; each launch it serves runs in a child forked from it, its output
in the run's worker.log, how it ended reported back; a launch it does not serve starts a fresh
process as before."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ablate.console import Progress
from launch import local, warm_start
from tests.helpers import FAST, ROOT, compose_spec, started_pids

# A stand-in worker: prints while it "imports", then, in each point's child, the arguments it runs
# with and its pid; `exitN` exits with N, `killed` dies of SIGKILL, `hold=PATH` runs while PATH exists,
# `prepared` prints whether the server imported the module its preparation imports, `frozen` whether
# it starts with objects the collector leaves alone.
STAND_IN = [sys.executable, "-c", """
import os, signal, sys, time
print('imported', flush=True)
from launch import warm_start
def prepare(args):  # `fails` in a point's arguments: its preparation raises
    if 'fails' in args:
        raise RuntimeError('prepare failed')
    import wave
args = warm_start.arguments(sys.argv[1:], prepare)
print('running', args, os.getpid(), flush=True)
for arg in args or ():
    if arg.startswith('exit'):
        sys.exit(int(arg[4:]))
    if arg == 'killed':
        os.kill(os.getpid(), signal.SIGKILL)
    if arg == 'prepared':
        print('wave' in sys.modules, flush=True)
    if arg == 'frozen':
        import gc
        print(gc.get_freeze_count() > 0, flush=True)
    if arg.startswith('hold='):
        while os.path.exists(arg[5:]):
            time.sleep(0.05)
"""]


@pytest.fixture(autouse=True)
def no_warm_worker_left():
    yield
    warm_start.drop()


def ran(log) -> tuple[list[str], int]:
    """What a stand-in's point printed: its arguments and pid."""
    *args, pid = log.read_text().removeprefix("running ").split()
    return ast.literal_eval(" ".join(args)), int(pid)  # the list as Python printed it


def test_the_launch_runs_in_a_child_of_the_waiting_server_its_output_in_worker_log(tmp_path):
    env, log = local.worker_env({}), tmp_path / "run" / local.LOG
    log.parent.mkdir()
    warm_start.prestart(STAND_IN, env)
    server = warm_start._waiting.proc
    worker = warm_start.take(STAND_IN, ["spec.json"], env, log)
    assert worker.wait(timeout=60) == 0 and worker.returncode == 0
    # what it printed while it imported went nowhere; from the go on, into the point's log
    assert ran(log) == (["spec.json"], worker.pid) and worker.pid != server.pid
    assert warm_start._waiting.proc is server and server.poll() is None  # it serves the next


def test_a_server_runs_point_after_point_each_in_a_process_of_its_own(tmp_path):
    env = local.worker_env({})
    warm_start.prestart(STAND_IN, env)
    server = warm_start._waiting.proc
    pids = []
    for i in range(3):
        worker = warm_start.take(STAND_IN, [f"point{i}"], env, tmp_path / f"log{i}")
        assert worker.wait(timeout=60) == 0
        assert ran(tmp_path / f"log{i}") == ([f"point{i}"], worker.pid)
        pids.append(worker.pid)
        warm_start.prestart(STAND_IN, env)  # the next point's job finds it waiting: no new process
        assert warm_start._waiting.proc is server
    assert len(set(pids)) == 3 and server.pid not in pids


def test_a_worker_started_for_one_point_runs_it_itself(tmp_path):
    """A submitit job's: no fork, the process started ahead is the point's, as one started for
    it would be; it serves nothing after."""
    env = local.worker_env({})
    warm_start.prestart([*STAND_IN, "spec.json"], env, once=True)
    server = warm_start._waiting.proc
    worker = warm_start.take([*STAND_IN, "spec.json"], [], env, tmp_path / "log")
    assert worker is server and worker.wait(timeout=60) == 0
    assert ran(tmp_path / "log") == (["spec.json"], server.pid) and warm_start._waiting is None


@pytest.mark.parametrize("arg, code", [("exit3", 3), ("killed", -signal.SIGKILL)])
def test_how_a_forked_point_ended_is_its_exit_code_as_a_subprocess_would_say(tmp_path, arg, code):
    env = local.worker_env({})
    warm_start.prestart(STAND_IN, env)
    assert warm_start.take(STAND_IN, [arg], env, tmp_path / "log").wait(timeout=60) == code
    assert warm_start.take(STAND_IN, ["next"], env, tmp_path / "next").wait(timeout=60) == 0


def test_a_server_with_a_point_running_serves_no_second_one_and_lets_it_finish_when_it_goes(tmp_path):
    """One point at a time per server; one let go while its point runs (another command's launch
    came) goes once that point ends, which is not killed with it."""
    env, hold = local.worker_env({}), tmp_path / "hold"
    hold.touch()
    warm_start.prestart(STAND_IN, env)
    server = warm_start._waiting.proc
    running = warm_start.take(STAND_IN, [f"hold={hold}"], env, tmp_path / "log")
    assert running.poll() is None
    assert warm_start.take(STAND_IN, ["second"], env, tmp_path / "second") is None
    warm_start.prestart([*STAND_IN, "other"], env)  # another command: the server is let go
    assert warm_start._waiting.proc is not server and running.poll() is None and server.poll() is None
    hold.unlink()
    assert running.wait(timeout=60) == 0 and server.wait(timeout=60) is not None


def test_a_point_dies_with_its_server(tmp_path):
    """A server killed outright (its own starter killed: PDEATHSIG) takes its running point with
    it, and the launch hears of a kill."""
    env, hold = local.worker_env({}), tmp_path / "hold"
    hold.touch()
    warm_start.prestart(STAND_IN, env)
    server = warm_start._waiting.proc
    running = warm_start.take(STAND_IN, [f"hold={hold}"], env, tmp_path / "log")
    os.killpg(server.pid, signal.SIGKILL)
    assert running.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while alive(running.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(running.pid)


def alive(pid: int) -> bool:
    """Running: a process that exited but was never reaped (a zombie) is not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_waiting_worker_serves_the_next_launch_of_its_command_and_environment():
    env = local.worker_env({})
    warm_start.prestart(STAND_IN, env)
    first = warm_start._waiting.proc
    warm_start.prestart(STAND_IN, env)  # the job of the next point finds it waiting
    assert warm_start._waiting.proc is first
    warm_start.prestart([*STAND_IN, "other"], env)  # another command: a new one, the old one gone
    assert warm_start._waiting.proc is not first and first.wait(timeout=60) is not None


@pytest.mark.parametrize("change", ["command", "environment", "died"])
def test_a_launch_it_does_not_serve_gets_a_fresh_process(tmp_path, change):
    """The waiting worker stays for a later launch it serves; one that died goes."""
    env = local.worker_env({})
    warm_start.prestart(STAND_IN if change != "died" else [sys.executable, "-c", "import sys; sys.exit(3)"], env)
    waiting = warm_start._waiting.proc
    if change == "died":
        waiting.wait(timeout=60)
    launch = [*STAND_IN, "torchrun"] if change == "command" else STAND_IN
    other_env = {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert warm_start.take(launch, ["spec.json"], other_env if change == "environment" else env, tmp_path / "log") is None
    if change == "died":
        assert warm_start._waiting is None
    else:
        assert warm_start._waiting.proc is waiting and waiting.poll() is None
    assert not (tmp_path / "log").exists()


def test_a_launch_whose_environment_gained_what_torchs_import_sets_is_served(tmp_path):
    """torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR to its default where it is unset: a job
    that imports it after its first prestart (transformers does) is served by that server, which
    set the same default by its own imports."""
    env = local.worker_env({})
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    warm_start.prestart(STAND_IN, env)
    server = warm_start._waiting.proc
    worker = warm_start.take(STAND_IN, ["spec.json"], {**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"},
                             tmp_path / "log")
    assert worker is not None and worker.wait(timeout=60) == 0 and worker.pid != server.pid
    warm_start.prestart(STAND_IN, {**env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"})
    assert warm_start._waiting.proc is server


def test_the_server_prepares_each_point_before_it_forks_and_a_failed_preparation_is_the_points(tmp_path):
    """Its later points inherit what it imported for one, frozen: their collections skip it."""
    env = local.worker_env({})
    warm_start.prestart(STAND_IN, env)
    for point, prepared in (("fails", "False"), ("prepared", "True")):
        worker = warm_start.take(STAND_IN, [point, "prepared", "frozen"], env, tmp_path / point)
        assert worker.wait(timeout=60) == 0
        assert (tmp_path / point).read_text().splitlines()[-2:] == [prepared, "True"]


def test_a_dropped_warm_worker_exits_without_running_and_leaves_no_log(tmp_path):
    """A worker no point takes (the sweep ends, an invalid or pruned point) writes nothing."""
    warm_start.prestart(STAND_IN, local.worker_env({}))
    waiting = warm_start._waiting.proc
    warm_start.drop()
    assert waiting.poll() is not None and not list(tmp_path.iterdir())


def _spec_file(path: Path, overrides: list[str]) -> str:
    path.write_text(json.dumps({"config": compose_spec(overrides).to_config()}))
    return str(path)


QLORA = ["model=llama3.2-1b", "model.config.num_hidden_layers=2", "peft=qlora"]


def test_the_servers_imports_ask_nothing_of_cuda(tmp_path):
    """A child forked after CUDA's driver is set up cannot use CUDA: the worker's and torchrun's
    imports, and a point's preparation on a host with a GPU (all a server runs before it forks;
    here a Hugging Face model with QLoRA's adapters, whose libraries import torchao, which asks),
    must not ask whether there is a GPU. Every call that would set CUDA up raises here."""
    spec = _spec_file(tmp_path / "spec.json", [*QLORA, "device=cuda"])
    code = ("import sys, torch, torch.cuda\n"
            "def refusal(name):\n"  # one function per name: dynamo's rules map each torch function once
            "    def refuse(*a, **k): raise AssertionError(f'torch.cuda.{name} called at import')\n"
            "    return refuse\n"
            "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device', 'get_device_properties',"
            " 'get_device_capability', 'mem_get_info', 'set_device'):\n"
            "    setattr(torch.cuda, name, refusal(name))\n"
            "import ablate.worker, launch.torchrun, launch.nvml\n"
            "launch.nvml.visible_gpu_count = lambda: 1\n"  # the GPU host's NVML, read without CUDA
            f"ablate.worker.prepare([{spec!r}])\n"
            "print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"


def test_torchruns_launch_settings_leave_cuda_unset_for_the_ranks_it_forks():
    """launch/torchrun.py forks a point's ranks from its own process, so making torchrun's launch
    settings there (LaunchConfig asks whether CUDA is available) must not set CUDA's driver up. A GPU
    host, as far as torch can tell: built with CUDA, NVML counting two GPUs, and the runtime's
    device count, which would set the driver up, refusing."""
    code = ("import os, torch, torch.cuda, launch.torchrun as t\n"  # imported first: as on a CPU host
            "torch.cuda._is_compiled = lambda: True\n"
            "torch.cuda._device_count_nvml = lambda: 2\n"
            "def refuse(*a, **k): raise AssertionError('cudaGetDeviceCount: CUDA set up before the fork')\n"
            "torch._C._cuda_getDeviceCount = refuse\n"
            "config = t.launch_config(['--standalone', '--nproc-per-node=2'])\n"
            "print(config.start_method, config.nproc_per_node, os.environ.get(t.NVML_CHECK))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["fork", "2", "None"]  # and the ranks' environment is left as it was


@pytest.mark.slow  # a sweep of Hugging Face and adapter points (15 s)
def test_a_point_on_a_host_without_a_gpu_is_prepared_with_its_models_and_adapters_libraries(tmp_path):
    spec = _spec_file(tmp_path / "spec.json", [*QLORA, "device=cpu"])
    code = (f"import sys, ablate.worker; ablate.worker.prepare([{spec!r}]); "
            "print('peft' in sys.modules, 'transformers.models.llama.modeling_llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "True True"


@pytest.fixture
def forks(monkeypatch) -> list:
    """The workers the launches took from a server (None for a launch that started its own)."""
    taken, take = [], warm_start.take
    monkeypatch.setattr(warm_start, "take", lambda *args: taken.append(take(*args)) or taken[-1])
    return taken


@pytest.mark.parametrize("submitit", [False, True])
def test_a_real_point_runs_in_a_fork_of_its_prestarted_worker_or_in_it_in_a_job_of_one_point(
        tmp_path, monkeypatch, forks, submitit):
    """The job's own path: a server prestarted for the point, then launched: the worker that
    reports is a child forked from the process started ahead, and the run is ok. In a submitit job
    (one point) the process started ahead has the point's spec path in its command, for `ps` to
    show, and runs the point itself."""
    from ablate.outcome import launch

    if submitit:
        monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    else:
        monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    spec, run_dir = compose_spec(FAST), tmp_path / "run"
    local.prestart(spec, run_dir / local.SPEC)
    server = warm_start._waiting
    assert (str(run_dir / local.SPEC) in server.cmd) == submitit
    outcome = launch(spec, run_dir, [], Progress("warm", stream=open(os.devnull, "w")))
    assert outcome.status == "ok", outcome.reason
    (worker,) = filter(None, forks)
    if submitit:
        assert worker is server.proc and started_pids(run_dir) == [server.proc.pid]
    else:
        assert worker.server is server and started_pids(run_dir) == [worker.pid] != [server.proc.pid]
    assert 0 <= outcome.phases["startup"]  # from the launch: what was left of its imports


def test_a_launch_replaces_the_spec_whole_for_a_reader_on_another_node(tmp_path):
    """Every node of a multi-node point writes the same spec.json while the other node's launcher
    may be reading it: the file is replaced, never truncated under an open reader."""
    from ablate.outcome import launch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / local.SPEC).write_text('{"written": "by the other node"}')
    with open(run_dir / local.SPEC) as reader:
        assert launch(compose_spec(FAST), run_dir, [], Progress("spec", stream=open(os.devnull, "w"))).status == "ok"
        assert json.loads(reader.read()) == {"written": "by the other node"}
    assert json.loads((run_dir / local.SPEC).read_text())["run_dir"] == str(run_dir)


def test_a_sweeps_points_run_in_forks_of_the_server_started_after_the_first_ones_measured_steps(
        tmp_path, monkeypatch, forks):
    """A sweep's points one after the other: once the first point's measured steps are done, a
    server starts importing, and every later launch runs in a child of it. Not in a submitit job
    (one point)."""
    from ablate.outcome import launch

    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    spec, quiet = compose_spec(FAST), Progress("warm", stream=open(os.devnull, "w"))
    assert launch(spec, tmp_path / "a", [], quiet).status == "ok"
    assert warm_start._waiting is not None
    server = warm_start._waiting
    for point in "bc":
        assert launch(spec, tmp_path / point, [], quiet).status == "ok"
        assert started_pids(tmp_path / point) == [forks[-1].pid] and forks[-1].server is server
        log = tmp_path / point / local.LOG  # kept only if the worker printed anything
        assert not log.exists() or "Traceback" not in log.read_text()
    b, c = filter(None, forks)
    assert b.pid != c.pid and warm_start._waiting is server

    warm_start.drop()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    assert launch(spec, tmp_path / "d", [], quiet).status == "ok"
    assert warm_start._waiting is None


def test_the_command_line_and_the_job_leave_torch_to_the_worker():
    """Nothing before the prestart imports torch: not the key check (of a preset's command line
    either, whose overlays set model keys), not the job module (else its 2 s on 2 cores would sit
    in front of the worker's start instead of beside it)."""
    code = ("import sys; from ablate.command_line import unknown_key\n"
            "for argv in (['batch_size=2'], ['experiment=demo'], ['scale=cpu', 'model=gpt2-xl']):\n"
            "    assert unknown_key(argv) is None, argv\n"
            "import ablate.job, ablate.__main__; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
