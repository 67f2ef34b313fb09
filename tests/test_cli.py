"""``lightning-pipe plan``: JSON content, the table, the model path, and errors on bad input."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pipe.cli import main
from lightning_pipe.cost.profile_file import load_profile
from lightning_pipe.partition import PlanRequest, partition


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_vgg16_straight_split_is_optimal(pipedream_profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = pipedream_profiles / "vgg16" / "graph.txt"
    result = _json(
        capsys, "plan", "--profile", str(profile), "--devices", "4", "--partitioner", "pipedream", "--straight"
    )
    oracle = partition(PlanRequest(load_profile(profile), 4, straight=True), "exact")
    assert result["partitioner"] == "pipedream"
    assert math.isclose(result["bottleneck_seconds"], oracle.bottleneck_seconds, rel_tol=1e-12)
    stages = result["stages"]
    assert len(stages) == 4 and all(stage["replicas"] == 1 for stage in stages)
    assert stages[0]["layers"][0] == 0 and stages[-1]["layers"][1] == result["layers"] - 1
    for before, after in itertools.pairwise(stages):
        assert after["layers"][0] == before["layers"][1] + 1
    assert max(stage["stage_seconds"] for stage in stages) == result["bottleneck_seconds"]
    # PipeDream profiles are in milliseconds: the JSON is in seconds (VGG-16 takes well under 10 s)
    assert 0.05 < result["bottleneck_seconds"] < 1.0
    assert all(stage["memory_bytes"] > 0 for stage in stages)


def test_json_has_every_documented_key(pipedream_profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = str(pipedream_profiles / "resnet18" / "graph.txt")
    result = _json(
        capsys,
        "plan",
        "--profile",
        profile,
        "--devices",
        "4",
        "--memory-limit",
        "40GB",
        "--schedule",
        "gpipe",
        "--microbatches",
        "8",
        "--bandwidth",
        "10GB/s",
        "--partitioner",
        "memory",
    )
    for key in ("partitioner", "stages", "bottleneck_seconds", "devices", "memory_limit_bytes", "memory_schedule"):
        assert key in result
    assert result["memory_limit_bytes"] == 40e9
    assert result["bandwidth_bytes_per_second"] == 10e9
    assert all(stage["memory_bytes"] <= 40e9 for stage in result["stages"])
    assert set(result["stages"][0]) >= {"layers", "replicas", "compute_seconds", "memory_bytes"}


def test_table_output(pipedream_profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = str(pipedream_profiles / "alexnet" / "graph.txt")
    assert main(["plan", "--profile", profile, "--devices", "2", "--partitioner", "noncontiguous"]) == 0
    out = capsys.readouterr().out
    assert "Pipeline bottleneck cost:" in out and "===== Partition (noncontiguous) =====" in out


def test_profile_a_builtin_model_and_save_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "resnet18.json"
    result = _json(
        capsys,
        "plan",
        "--model",
        "resnet18",
        "--input-shape",
        "3",
        "32",
        "32",
        "--batch-size",
        "2",
        "--repeats",
        "1",
        "--num-classes",
        "10",
        "--devices",
        "2",
        "--straight",
        "--partitioner",
        "flops",
        "--save-profile",
        str(saved),
    )
    costs = load_profile(saved)
    assert result["layers"] == len(costs) == 15  # stem 4 + 8 blocks + pool, flatten, fc
    assert all(layer.flops is not None for layer in costs.layers)
    assert costs.meta["batch_size"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "expected a whole number >= 1"),
        (["--devices", "4", "--memory-limit", "lots"], "cannot read 'lots' as a size"),
        (["--devices", "4", "--bandwidth=-3GB/s"], "cannot read"),
        (["--devices", "4", "--partitioner", "magic"], "invalid choice: 'magic'"),
    ],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--profile", "x.json", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_planning_errors_exit_2_without_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(tmp_path / "missing.json"), "--devices", "2"]) == 2
    assert "cannot read the profile" in capsys.readouterr().err
    profile = tmp_path / "tiny.json"
    profile.write_text(
        json.dumps(
            {
                "format": "lightning_pipe.profile",
                "version": 1,
                "layers": [
                    {
                        "forward_seconds": 1,
                        "backward_seconds": 1,
                        "activation_bytes": 1,
                        "saved_bytes": 1,
                        "param_bytes": 1e9,
                    }
                ],
            }
        )
    )
    assert main(["plan", "--profile", str(profile), "--devices", "1", "--memory-limit", "1GB"]) == 2
    err = capsys.readouterr().err
    assert "lightning-pipe plan: error: no partition on 1 device(s) fits the memory limit of 954 MiB" in err
    assert "Traceback" not in err


def test_console_script_runs(pipedream_profiles: Path) -> None:
    profile = str(pipedream_profiles / "gnmt" / "graph.txt")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.cli", "plan", "--profile", profile, "--devices", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(done.stdout)["profile"] == "gnmt"


def test_simulate_a_plan_and_a_costs_file(pipedream_profiles: Path, tmp_path: Path, capsys) -> None:
    profile = str(pipedream_profiles / "vgg16" / "graph.txt")
    assert main(["plan", "--profile", profile, "--devices", "4", "--straight", "--json"]) == 0
    plan = tmp_path / "plan.json"
    plan.write_text(capsys.readouterr().out)
    simulated = _json(capsys, "simulate", "--schedule", "1f1b", "--plan", str(plan), "--microbatches", "8")
    stages = json.loads(plan.read_text())["stages"]
    slowest = max(stage["forward_seconds"] + stage["backward_seconds"] for stage in stages)
    assert simulated["stages"] == 4 and simulated["makespan"] >= 8 * slowest
    assert simulated["peak_activations"]["bytes"][0] == 4 * stages[0]["saved_bytes"]
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"forward": [1, 2], "backward": [2, 4], "activation_bytes": [8, 0]}))
    result = _json(
        capsys, "simulate", "--schedule", "gpipe", "--costs", str(costs), "--microbatches", "2", "--bandwidth", "4B/s"
    )
    # stage 1: F0 at 1 + 2 (transfer), F1 after it, B0, B1 -> 15; stage 0: B1 at 15 + 2 -> 19
    assert result["makespan"] == 19
    gpipe = ["simulate", "--schedule", "gpipe", "--costs", str(costs), "--microbatches", "2"]
    late = _json(capsys, *gpipe, "--latency", "1")
    assert late["makespan"] == 19 - 4 + 2 * 1  # no bandwidth given: each message costs only its latency
    # each message costs 1 at both ends: stage 1 F [2,5] [5,8], B [8,13] [13,18]; stage 0's last B [18,21]
    assert _json(capsys, *gpipe, "--overhead", "1")["makespan"] == 21
    unit = ["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2"]
    assert _json(capsys, *unit)["makespan"] == 9
    assert _json(capsys, *unit, "--contention", "2")["makespan"] == 12  # tests/test_simulate_contention.py
    assert _json(capsys, *unit, "--early-gradients")["makespan"] == 8  # (P - 1) W sooner, W = B / 2 = 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--schedule", "1f1b", "--microbatches", "4"], "give --stages"),
        (["--schedule", "2bw", "--stages", "4", "--microbatches", "2"], "2BW needs m >= P - 1"),
        (["--schedule", "kperiodic", "--stages", "4", "--microbatches", "2"], "kperiodic needs k"),
        (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--plot", "x.gif"], "suffixes .png, .svg"),
        (["--schedule", "1f1b", "--stages", "2", "--microbatches", "2", "--contention", "0.5"], "factor >= 1"),
    ],
)
def test_simulate_errors(argv: list[str], message: str, capsys) -> None:
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "text", "message"),
    [
        ("--plan", "[1, 2]", 'plan.json is not a plan: a plan is a JSON object with a "stages" list'),
        ("--plan", '{"stages": [{"replicas": 1}]}', 'plan.json: stages[0] lacks "layers"'),
        ("--plan", '{"stages": [{"layers": [0, 1]}]}', "plan.json: stages[0] lacks forward_seconds, backward_seconds"),
        ("--costs", "{", "plan.json: invalid JSON at line 1: Expecting property name enclosed in double quotes"),
        ("--costs", "[1]", 'plan.json: a costs file is a JSON object with "forward" and "backward" lists'),
    ],
)
def test_simulate_names_a_broken_file(tmp_path: Path, option: str, text: str, message: str, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert main(["simulate", "--schedule", "1f1b", "--microbatches", "2", option, str(path)]) == 2
    assert f"lightning-pipe simulate: error: {tmp_path}/{message}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("replicas", "message"), [("2,0", "got 0: give one worker count >= 1 per"), ("2,x", "e.g. 2,1,1")]
)
def test_stage_replicas_must_be_counts(replicas: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--schedule", "1f1b_rr", "--microbatches", "2", "--stage-replicas", replicas])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_simulate_replicated_plan_places_its_replicas(pipedream_profiles: Path, tmp_path: Path, capsys) -> None:
    profile = str(pipedream_profiles / "resnet18" / "graph.txt")
    plan = _json(capsys, "plan", "--profile", profile, "--devices", "4", "--bandwidth", "1GB/s")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    result = _json(capsys, "simulate", "--schedule", "1f1b_rr", "--plan", str(path), "--microbatches", "4")
    assert result["stages"] == len(plan["stages"]) and result["workers"] == plan["devices_used"]


def test_simulate_cli_writes_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, memory, trace, saved = (tmp_path / n for n in ("t.png", "m.svg", "trace.json", "schedule.json"))
    argv = ["simulate", "--schedule", "zb_h1", "--stages", "4", "--microbatches", "6", "--json"]
    argv += ["--plot", str(plot), "--memory-plot", str(memory), "--trace", str(trace), "--save-schedule", str(saved)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("makespan", "throughput", "bubble_fraction", "peak_activations", "weight_versions"):
        assert key in result
    assert result["peak_activations"]["count"] == [4, 3, 2, 1]
    assert plot.stat().st_size > 0 and memory.stat().st_size > 0
    assert json.loads(trace.read_text())["traceEvents"]
    assert json.loads(saved.read_text())["family"] == "zb_h1"


def test_plan_of_a_users_module(capsys: pytest.CaptureFixture[str]) -> None:
    """``--model package.module:Class`` captures the module's forward (here the tutorial's ResNet-18
    with its log_softmax, fed a random --input-shape) and plans its layers; the layers and cuts are
    printed (to stderr beside --json), named after the modules they call."""
    result = _json(
        capsys, "plan", "--model", "tests.user_modules:LitResnet", "--input-shape", "3", "8", "8",
        "--batch-size", "2", "--devices", "2", "--straight", "--repeats", "1", "--init", '{"lr": 0.02}',
    )  # fmt: skip
    assert result["profile"] == "LitResnet" and len(result["stages"]) == 2
    assert result["stages"][-1]["layers"][1] == result["layers"] - 1
    printed = capsys.readouterr()
    assert main(["plan", "--model", "tests.user_modules:LitResnet", "--input-shape", "3", "8", "8",
                 "--batch-size", "2", "--devices", "2", "--straight", "--repeats", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "Captured forward" in printed and "model.conv1" in printed and "<- stage cut" not in printed
    assert main(["plan", "--model", "tests.user_modules:Nothing", "--devices", "2"]) == 2
    assert "cannot import tests.user_modules:Nothing" in capsys.readouterr().err


def test_consolidate_refuses_what_is_not_a_sharded_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``lightning-pipe consolidate`` on a directory or file that no sharded save wrote says what it needs."""
    (tmp_path / "file.ckpt").write_bytes(b"")
    for given in (tmp_path, tmp_path / "file.ckpt"):
        assert main(["consolidate", str(given)]) == 2
        assert "is not a sharded checkpoint (a directory with meta.pt" in capsys.readouterr().err


def test_plan_auto_prints_the_searchs_ranking(pipedream_profiles: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --auto`` ranks as :func:`lightning_pipe.auto.search` does (its JSON the same candidates in
    the same order), says why the winner won, and keeps the delayed-weight families out unless allowed."""
    from lightning_pipe.auto import search
    from lightning_pipe.cost.network import Network

    profile = str(pipedream_profiles / "alexnet" / "graph.txt")
    argv = ["plan", "--profile", profile, "--devices", "2", "--auto", "--top", "20"]
    result = _json(capsys, *argv)
    costs, free = load_profile(profile), Network(float("inf"))
    expected = search(costs, 2, profile_microbatches=2, network=free)
    got = [(c["family"], c["microbatches"], c["recompute"], c["bounds"]) for c in result["candidates"]]
    assert got == [(c.family, c.microbatches, list(c.recompute), [list(b) for b in c.bounds]) for c in expected[:20]]
    assert [c["step_seconds"] for c in result["candidates"]] == [c.step_seconds for c in expected[:20]]
    assert {c["rule"] for c in result["candidates"]} == {"sync"}
    assert main([*argv, "--rule", "delayed"]) == 0
    table = capsys.readouterr().out
    delayed = search(costs, 2, rule="delayed", profile_microbatches=2, network=free)
    assert f"{delayed[0].label} wins: {delayed[0].why}" in table
    assert table.count("\n| ") == 20  # one row per candidate
    assert main(["plan", "--profile", profile, "--devices", "2", "--rule", "2bw"]) == 2
    assert "--rule chooses the rules --auto's search may pick: give --auto too" in capsys.readouterr().err
