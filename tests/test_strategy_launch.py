"""The strategy started as users start Lightning: ``python train.py`` (Lightning re-runs the script
for the other processes) and a spawn-based start, with a registered name in ``Trainer(strategy=...)``,
profiling and planning on the first batch, and the end-of-fit report in the log directory; and started
from outside, one process per device on every node, as ``torchrun`` and SLURM's ``srun`` do (two
nodes simulated on this machine), where Lightning's cluster environment gives each process its rank."""

from __future__ import annotations

import contextlib
import csv
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_pipe.util.units import parse_bytes
from tests.lightning_cases import Chain, loader, state, trainer

ROOT = Path(__file__).resolve().parent.parent


def _script(tmp_path: Path, strategy: str, *options: str) -> tuple[str, Path]:
    """The script run to its end: every process exits with status 0 and no ``terminate called`` (a gloo
    thread aborting a finished process at interpreter exit, which a scheduler would mark as a failed
    job; the process groups are closed at exit)."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.strategy_script", str(tmp_path), strategy, *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "terminate called" not in output, (strategy, output[-2000:])
    if "--evaluate" in options:
        assert output.count("evaluated: rank=") == 2, output[-2000:]
    return output, tmp_path / "lightning_logs" / "version_0"


def _plain(tmp_path: Path, steps: int = -1) -> dict[str, torch.Tensor]:
    """The script's model trained by plain Lightning on one device (``steps``: stopped after them)."""
    model = Chain(blocks=4, width=32)
    trainer(tmp_path / "plain", "auto", 1, max_epochs=2, max_steps=steps).fit(model, loader(8), loader(2, seed=7))
    return state(model)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["pipe", "pipe_spawn"])
def test_launched_by_lightning(tmp_path: Path, strategy: str) -> None:
    """``Trainer(strategy="pipe", devices=2)`` (1F1B) in a plain script, with the script re-run or
    with spawned processes: the plan, prediction and set-up time are printed, the trained model equals plain
    Lightning's, and the report (timeline picture, trace, pipeline metrics) is in the log directory. The
    re-run script then validates, tests and predicts with the same trainer."""
    output, logs = _script(tmp_path, strategy, *(() if strategy.endswith("spawn") else ("--evaluate",)))
    assert "===== Partition (time) =====" in output and "Predicted schedule" in output
    assert output.count("After fit, each rank's module holds only the stages the rank ran") == 1  # rank 0, once
    assert re.search(r"Pipeline set-up [\d.]+ s: capture [\d.]+ s, verify [\d.]+ s, profile [\d.]+ s", output)
    assert output.count("Pipeline set-up") == 1
    # each rank maps one ring to its neighbour and one from it, sized to the plan's small messages
    rings = re.search(r"shared-memory rings: rank 0: [^,]+ \+ ([^,]+), rank 1: [^,]+ \+ (.+)", output)
    assert rings is not None
    both = [parse_bytes(rings.group(i).strip()) for i in (1, 2)]
    assert both[0] == both[1] and 2 * 4096 <= both[0] < 2**20, both  # not 2 x the default 64 MiB
    assert "pipeline: measured" in output
    assert (logs / "pipeline_timeline.png").stat().st_size > 10_000
    assert '"traceEvents"' in (logs / "pipeline_trace.json").read_text()[:200]
    with open(logs / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert any(row.get("pipeline/step_ms_measured") for row in rows)
    assert any(row.get("pipeline/stage1_backward_ms") for row in rows)
    assert sum(1 for row in rows if row.get("train_loss_step")) == 16
    final = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
    expected = _plain(tmp_path)
    for name, value in expected.items():
        assert torch.allclose(final[name], value, atol=1e-5), name


# what a launcher tells its processes: none may leak from this process into the launch under test
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_")
_WAIT_SECONDS = 100  # for all processes of one launch (each run takes ~10 s alone)


def _environment() -> dict[str, str]:
    """This process's environment without any launcher's variables, one thread per process (two cores)."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in _LAUNCH_VARIABLES and not name.startswith(_LAUNCH_PREFIXES)
    }
    environment["OMP_NUM_THREADS"] = "1"
    return environment


def _free_port() -> int:
    """A TCP port nothing listens on, in 15000-24999 (where SLURMEnvironment puts a job's port)."""
    for port in random.sample(range(15000, 25000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15000-24999")


def _descendants(pid: int) -> list[int]:
    """``pid``'s descendants, from ``/proc`` (torchrun starts its workers in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    for pid in [*_descendants(process.pid), process.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait()


def _run_together(commands: list[list[str]], environments: list[dict[str, str]], logs: Path) -> list[str]:
    """Start one process per command (as one would on each node), wait for all of them; when one fails
    or they run out of time, kill every process (and what it started) and fail with their output."""
    logs.mkdir()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index, (command, environment) in enumerate(zip(commands, environments, strict=True)):
            with open(logs / f"process{index}.log", "wb") as output:
                processes.append(
                    subprocess.Popen(command, cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT)
                )
        deadline = time.monotonic() + _WAIT_SECONDS
        while True:
            codes = [process.poll() for process in processes]  # every one polled: any() would stop early
            if None not in codes or any(codes) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        running = [index for index, process in enumerate(processes) if process.poll() is None]
    finally:
        for process in processes:
            if process.poll() is None:
                _kill_tree(process)
    outputs = [(logs / f"process{index}.log").read_text() for index in range(len(commands))]
    report = f"killed: processes {running} (another failed, or {_WAIT_SECONDS} s passed)\n" + "\n".join(
        f"----- process {index}: exit {process.returncode} -----\n{output[-2500:]}"
        for index, (process, output) in enumerate(zip(processes, outputs, strict=True))
    )
    assert all(process.returncode == 0 for process in processes), report
    return outputs


def _check_ranks(outputs: list[str], ranks: list[tuple[int, int, int]], environment: str) -> None:
    """Process ``i`` trained as global rank, node and local rank ``ranks[i]`` under ``environment``."""
    world = len(ranks)
    for output, (rank, node, local) in zip(outputs, ranks, strict=True):
        line = f"launch: rank={rank} world={world} node={node} local={local} environment={environment}"
        assert line in output, output[-2500:]


def _check_result(tmp_path: Path) -> None:
    """Global rank 0 wrote the trained model, which equals plain Lightning's, and the report."""
    (logs,) = (tmp_path / "lightning_logs").iterdir()
    assert (logs / "pipeline_timeline.png").stat().st_size > 10_000
    with open(logs / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert sum(1 for row in rows if row.get("train_loss_step")) == 16
    assert any(row.get("pipeline/step_ms_measured") for row in rows)
    final = torch.load(tmp_path / "final.ckpt", weights_only=False)["state_dict"]
    for name, value in _plain(tmp_path).items():
        assert torch.allclose(final[name], value, atol=1e-5), name


def _slurm_job() -> str:
    """A job id whose port (Lightning's: 15000 + the id's last four digits) nothing listens on."""
    return f"42{_free_port() - 15000:04d}"


def _slurm_environments(job: str, devices: int, num_nodes: int) -> list[dict[str, str]]:
    """What ``srun --ntasks-per-node=devices --nodes=num_nodes`` gives each task, on this machine."""
    tasks = devices * num_nodes
    return [
        {
            **_environment(),
            "SLURM_JOB_ID": job,
            "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_NNODES": str(num_nodes),
            "SLURM_NTASKS": str(tasks),
            "SLURM_NTASKS_PER_NODE": str(devices),
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % devices),
            "SLURM_NODEID": str(rank // devices),
        }
        for rank in range(tasks)
    ]


def _script_command(tmp_path: Path, devices: int, num_nodes: int) -> list[str]:
    return ["-m", "tests.strategy_script", str(tmp_path), "pipe", f"--devices={devices}", f"--num-nodes={num_nodes}"]


@pytest.mark.timeout(150)
def test_torchrun_two_nodes(tmp_path: Path) -> None:
    """``Trainer(devices=1, num_nodes=2, strategy="pipe")`` started by ``torchrun --nnodes 2`` on each
    of two (simulated) nodes: Lightning takes the ranks from TorchElasticEnvironment, the stage on
    node 1 is global rank 1, and training equals plain Lightning's. Guards against a strategy that
    loses ``num_nodes`` (Lightning's launcher refuses devices x nodes != world size), derives ranks
    from the local rank only, or only works when Lightning starts the processes itself."""
    port = _free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *_script_command(tmp_path, devices=1, num_nodes=2),
        ]
        for node in (0, 1)
    ]
    outputs = _run_together(commands, [_environment(), _environment()], tmp_path / "processes")
    _check_ranks(outputs, [(0, 0, 0), (1, 1, 0)], "TorchElasticEnvironment")
    _check_result(tmp_path)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("devices", "num_nodes"), [(2, 1), (1, 2)])
def test_slurm(tmp_path: Path, devices: int, num_nodes: int) -> None:
    """``Trainer(devices=..., num_nodes=..., strategy="pipe")`` in processes started as ``srun`` starts
    them (``--ntasks-per-node=devices --nodes=num_nodes``: SLURM's variables and nothing else, the
    address and port derived by Lightning from the node list and job id): Lightning picks
    SLURMEnvironment, its check of devices and nodes against the tasks passes, and training equals
    plain Lightning's. Guards against a strategy that starts processes of its own under SLURM, or
    takes its ranks from anything but the cluster environment."""
    tasks = devices * num_nodes
    environments = _slurm_environments(_slurm_job(), devices, num_nodes)
    commands = [[sys.executable, *_script_command(tmp_path, devices, num_nodes)]] * tasks
    outputs = _run_together(commands, environments, tmp_path / "processes")
    ranks = [(rank, rank // devices, rank % devices) for rank in range(tasks)]
    _check_ranks(outputs, ranks, "SLURMEnvironment")
    _check_result(tmp_path)


def _check_stopped(output: str, step: int) -> None:
    """Both ranks raised ``SIGTERMException`` at ``step`` (the script's ``stopped:`` lines)."""
    lines = sorted(re.findall(r"stopped: rank=\S+ step=\S+ exception=\w+", output))
    assert lines == [f"stopped: rank={rank} step={step} exception=SIGTERMException" for rank in (0, 1)], output[-3000:]


@pytest.mark.timeout(150)
def test_sigterm_stops_every_rank_at_one_batch(tmp_path: Path) -> None:
    """SIGTERM to one rank of a 1F1B pipeline started by Lightning (``python train.py``), as a cluster
    preempting a job: every rank raises Lightning's ``SIGTERMException`` at the same batch (the one
    after the batch whose logs carried the flag), its ``on_exception`` callback saves a checkpoint
    (a collective every rank joins), and that checkpoint holds what plain Lightning has after as
    many steps. Guards against Lightning's own handler, whose broadcast from inside the signal
    handler waits for ever under a pipeline, and against ranks stopping at different batches."""
    command = [sys.executable, "-m", "tests.strategy_script", str(tmp_path), "pipe", "--send=SIGTERM", "--to-rank=1"]
    # exit 0: SIGTERMException is a SystemExit
    (output,) = _run_together([command], [_environment()], tmp_path / "processes")
    _check_stopped(output, step=4)
    checkpoint = torch.load(tmp_path / "stopped.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4
    for name, value in _plain(tmp_path, 4).items():
        assert torch.allclose(checkpoint["state_dict"][name], value, atol=1e-5), name
    Chain.load_from_checkpoint(tmp_path / "stopped.ckpt")


@pytest.mark.timeout(150)
def test_sigterm_under_torchrun_with_a_non_flushing_schedule(tmp_path: Path) -> None:
    """SIGTERM to rank 0 of a 2BW pipeline started by ``torchrun``: the flag reaches the other rank
    with the logs one batch later (2BW leaves them in flight), and both stop at step 5, the
    checkpoint saved on the way out loading without the strategy."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}",
        "-m",
        "tests.strategy_script",
        str(tmp_path),
        "pipe_2bw",
        "--send=SIGTERM",
        "--to-rank=0",
    ]
    (output,) = _run_together([command], [_environment()], tmp_path / "processes")
    _check_stopped(output, step=5)
    assert torch.load(tmp_path / "stopped.ckpt", weights_only=False)["global_step"] == 5
    Chain.load_from_checkpoint(tmp_path / "stopped.ckpt")


@pytest.mark.timeout(150)
def test_slurm_requeue_signal(tmp_path: Path) -> None:
    """SLURM's warning before preemption (SIGUSR1, ``--signal=USR1@90``) to one task of a 1F1B
    pipeline: at the next batch every rank saves Lightning's ``hpc_ckpt_1.ckpt`` (a collective, not
    from inside the handler), ``scontrol requeue JOB`` runs once (a stand-in ``scontrol`` on the
    path records it), and training goes on to the same result as plain Lightning's."""
    job = _slurm_job()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.calls"}\n')
    scontrol.chmod(0o755)
    environments = [
        {**environment, "PATH": f"{bin_dir}:{os.environ['PATH']}"} for environment in _slurm_environments(job, 2, 1)
    ]
    command = [sys.executable, *_script_command(tmp_path, 2, 1), "--send=SIGUSR1", "--to-rank=1"]
    _run_together([command] * 2, environments, tmp_path / "processes")
    assert (tmp_path / "scontrol.calls").read_text() == f"requeue {job}\n"
    checkpoint = torch.load(tmp_path / "hpc_ckpt_1.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4
    for name, value in _plain(tmp_path, 4).items():
        assert torch.allclose(checkpoint["state_dict"][name], value, atol=1e-5), name
    _check_result(tmp_path)


@pytest.mark.timeout(120)
def test_a_rank_0_failing_at_start_up_stops_the_rank_it_launched(tmp_path: Path) -> None:
    """Rank 0 cannot listen on its port (another process holds it) and fails at once; the rank it
    re-ran, whose rendezvous would wait for it for 30 minutes, stops within seconds saying why. The
    run returns only when both have exited (they share its output pipes)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        environment = {**_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(holder.getsockname()[1])}
        start = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "tests.strategy_script", str(tmp_path), "pipe"],
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=100,
        )
        elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert "EADDRINUSE" in run.stderr
    assert "rank 1 stops: the process that launched it (rank 0, pid" in run.stderr, run.stderr[-3000:]
    assert elapsed < 60


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["pipe_2bw", "pipe_2bw_spawn"])
def test_non_flushing_fits_launched_by_lightning(tmp_path: Path, strategy: str) -> None:
    """2BW re-run (then validating, testing and predicting with the same trainer) and spawned: each fit
    ends with its steps drained and every process exits cleanly (:func:`_script`), as 1F1B's do in
    :func:`test_launched_by_lightning`. A step's values are logged with the next batch (the relay does not
    wait for the last stage at a step boundary), the last two of an epoch with its last: 7 rows of 8."""
    _, logs = _script(tmp_path, strategy, *(() if strategy.endswith("spawn") else ("--evaluate",)))
    with open(logs / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train_loss_step")]
    assert len(rows) == 2 * 7


@pytest.mark.timeout(200)
def test_forkserver_processes_start_as_spawned_ones(tmp_path: Path) -> None:
    """``start_method="forkserver"``, two fits in one process as a multirun's jobs: the second fit's
    processes come from the server the first one started, yet each sees the environment, seed and
    deterministic-algorithms flag of its own call, holds no parameter in memory shared with another
    process (as spawn's do on CPU), and the trained model equals plain Lightning's."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.forkserver_script", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = sorted(re.findall(r"seen: value=(\w+) rank=(\d) seed=(\d) deterministic=(\w+) shared=(\d+)", run.stdout))
    assert seen == [
        ("first", "0", "1", "False", "0"),
        ("first", "1", "1", "False", "0"),
        ("second", "0", "2", "True", "0"),
        ("second", "1", "2", "True", "0"),
    ]
    expected = _plain(tmp_path)
    for fit in ("first", "second"):
        trained = torch.load(tmp_path / f"{fit}.pt", weights_only=False)
        for name, value in expected.items():
            assert torch.allclose(trained[name], value, atol=1e-5), (fit, name)


def test_forkserver_hands_over_no_cuda_state_it_would_have_to_create(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random states handed to forkserver processes leave CUDA's out while this process has not
    initialised CUDA: reading them would create a CUDA context in a process that trains on no device."""
    from lightning_pipe.strategy.launchers import _global_states

    def refuse() -> None:
        raise AssertionError("CUDA's random states read: that initialises CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", refuse)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    states = _global_states()
    assert "torch.cuda" not in states.rng_states and torch.equal(states.rng_states["torch"], torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["cuda state"])
    assert _global_states().rng_states["torch.cuda"] == ["cuda state"]  # initialised: handed over, as spawn does


_UNGUARDED = """
import lightning as L
from lightning_pipe import PipelineStrategy
from tests.lightning_cases import Chain, loader

strategy = PipelineStrategy(start_method="forkserver")
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False)
trainer.fit(Chain(blocks=4, width=32), loader(2))
"""


@pytest.mark.timeout(150)
def test_forkserver_refuses_a_script_without_a_main_guard(tmp_path: Path) -> None:
    """A script that fits at import, started with ``start_method="forkserver"``: each process imports
    the script first and reaches ``Trainer.fit`` again; the run stops (no process left waiting) with
    an error that says to guard the training code, or to use ``popen``."""
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0
    assert 'put the code that trains under `if __name__ == "__main__":`' in run.stderr, run.stderr[-3000:]
    assert "start_method='popen'" in run.stderr
