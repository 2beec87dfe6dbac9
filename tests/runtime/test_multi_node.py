"""The CLI recipe runs unchanged on several nodes: 2 nodes x 1 process (two `torchrun --nnodes 2` on loopback)
logs exactly the losses of 1 node x 2 processes.

Both runs are the same `python -m trl_distill` command line (ZeRO-2 student, ZeRO-3 teacher, DeepSpeed on CPU
over gloo); only the launcher differs. On loopback nothing extra is needed beyond `--master_addr 127.0.0.1`;
the test sets `GLOO_SOCKET_IFNAME=lo` anyway, so gloo never picks an interface from the host name (the way
`GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` pin the cluster NIC on real nodes, see examples/multi_node.md), and
`LOGLEVEL=INFO` so each torchrun agent prints its rendezvous result (global ranks and world size).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trl_distill.runtime.distributed import free_port
from trl_distill.testing import kill_tree, logged, synthetic_prompt_completion

ROOT = Path(__file__).parents[2]
MAX_STEPS = 4
# The first DeepSpeed launch on a machine may JIT-build its CPU comm op (minutes); later ones take ~15 s.
FIRST_TIMEOUT, TIMEOUT = 600, 240
ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "GLOO_SOCKET_IFNAME": "lo", "LOGLEVEL": "INFO"}


def cli_args(tiny_pair, dataset, output_dir) -> list[str]:
    """The one command line both launches run. A checkpoint at the last step keeps `trainer_state.json` (its
    `log_history` has the unrounded losses; stdout only has rounded strings, and `--save_strategy no` writes no
    state). `--learning_rate 2e-3` makes the losses move, so equal curves mean equal optimizer steps too."""
    return [
        "--model_name_or_path", tiny_pair["student"], "--teacher_model_name_or_path", tiny_pair["teacher"],
        "--dataset_name", str(dataset), "--output_dir", str(output_dir),
        "--deepspeed", str(ROOT / "configs/deepspeed/zero2_student.json"),
        "--teacher_deepspeed", str(ROOT / "configs/deepspeed/zero3_teacher.json"),
        "--bf16", "false", "--gradient_checkpointing", "false", "--max_steps", str(MAX_STEPS), "--logging_steps", "1",
        "--seed", "0", "--report_to", "none", "--save_strategy", "steps", "--save_steps", str(MAX_STEPS),
        "--disable_tqdm", "true", "--lr_scheduler_type", "constant", "--learning_rate", "2e-3",
        "--log_level", "info",  # each node's main process logs "Total train batch size (w. parallel, ...) = N"
    ]


def torchrun(*launcher_args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "trl_distill"]


def run_together(commands: list[list[str]], logs: list[Path], timeout: float) -> list[str]:
    """Start every command at once (each in its own session, output to its log) and wait for all of them.

    If one fails, or they run past `timeout` seconds, kill every process group (a failed node leaves its peers
    waiting in a collective forever) and fail with the outputs. Returns each command's output.
    """
    env = {**os.environ, **ENV}
    procs, timed_out = [], False
    try:
        for command, log in zip(commands, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True, cwd=ROOT))
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.2)
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in procs:
            kill_tree(p.pid)
        for p in procs:
            p.wait()
    outputs = [log.read_text() for log in logs]
    if hung or any(p.returncode for p in procs):
        why = f"timed out after {timeout:.0f} s" if timed_out else "failed"
        report = "\n".join(f"--- {' '.join(map(str, c))} (exit {p.returncode}):\n{o[-6000:]}"
                           for c, p, o in zip(commands, procs, outputs))
        pytest.fail(f"launch {why}:\n{report}")
    return outputs


def losses(output_dir: Path) -> dict[str, dict[int, float]]:
    state = json.loads((output_dir / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return {key: logged(state["log_history"], key) for key in ("loss", "kd_loss", "ce_loss")}


@pytest.mark.distributed
def test_two_nodes_log_the_same_losses_as_two_processes_on_one_node(tiny_pair, tmp_path):
    dataset = tmp_path / "pc.jsonl"
    synthetic_prompt_completion(32).to_json(dataset)
    one_node, two_nodes = tmp_path / "one_node", tmp_path / "two_nodes"

    # (a) 1 node x 2 processes
    run_together(
        [torchrun("--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()))
         + cli_args(tiny_pair, dataset, one_node)],
        [tmp_path / "one_node.log"], FIRST_TIMEOUT,
    )
    # (b) 2 nodes x 1 process: the same command on each "node", node_rank 0 hosting the rendezvous
    port = str(free_port())
    node0, node1 = run_together(
        [torchrun("--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(rank), "--master_addr", "127.0.0.1",
                  "--master_port", port) + cli_args(tiny_pair, dataset, two_nodes) for rank in (0, 1)],
        [tmp_path / "node0.log", tmp_path / "node1.log"], TIMEOUT,
    )

    # node 1 joined a world of 2 as global rank 1, and its training process saw the global batch of 2 x 8
    assert "global_ranks=[1]" in node1 and "global_world_sizes=[2]" in node1
    assert "Total train batch size (w. parallel, distributed & accumulation) = 16" in node1
    assert node1.count("'kd_loss'") == MAX_STEPS  # each node's main process prints the log dicts
    for out in (one_node, two_nodes):
        assert (out / "model.safetensors").is_file(), sorted(p.name for p in out.iterdir())
        checkpoint = out / f"checkpoint-{MAX_STEPS}"
        # both ranks wrote their share of the checkpoint: RNG state and ZeRO-2 optimizer shard
        assert {p.name for p in checkpoint.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
        assert len(list(checkpoint.glob(f"global_step{MAX_STEPS}/zero_pp_rank_*_optim_states.pt"))) == 2

    expected, got = losses(one_node), losses(two_nodes)
    for key in ("loss", "kd_loss", "ce_loss"):
        assert list(expected[key]) == list(range(1, MAX_STEPS + 1)), key
        assert got[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    assert expected["loss"][MAX_STEPS] < expected["loss"][1]  # the student trained: the curves are not flat


# ---- one GPU, no launcher ----
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def gpu_machine(monkeypatch):
    """No launch variables, and a GPU as far as `runtime.distributed` can tell; the environment as it was after
    (the code under test sets variables monkeypatch does not know of)."""
    from trl_distill.runtime import distributed

    saved = dict(os.environ)
    for name in (*LAUNCH_VARIABLES, *distributed._OTHER_LAUNCHERS, "ACCELERATE_USE_DEEPSPEED"):
        os.environ.pop(name, None)
    monkeypatch.setattr(distributed, "has_accelerator", lambda: True)
    yield distributed
    os.environ.clear()
    os.environ.update(saved)


def test_python_on_one_gpu_with_deepspeed_gets_a_one_process_group(gpu_machine, monkeypatch):
    """`python train.py --deepspeed ...` on a GPU: DeepSpeed's process group needs RANK, WORLD_SIZE and a master
    address even for one process (transformers leaves that to a launcher)."""
    from types import SimpleNamespace

    monkeypatch.setenv("SLURM_NTASKS", "1")  # an allocation of one task is still one process
    gpu_machine.prepare_cpu_distributed_state(SimpleNamespace(deepspeed="ds.json"))
    assert {k: os.environ[k] for k in LAUNCH_VARIABLES[:4]} == {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                                                 "LOCAL_WORLD_SIZE": "1"}  # fmt: skip
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 0 < int(os.environ["MASTER_PORT"]) < 65536


@pytest.mark.parametrize("launcher", ["OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "WORLD_SIZE", None])
def test_a_launchers_variables_or_no_deepspeed_leave_the_environment_alone(gpu_machine, monkeypatch, launcher):
    from types import SimpleNamespace

    if launcher:
        monkeypatch.setenv(launcher, "2")
    gpu_machine.prepare_cpu_distributed_state(SimpleNamespace(deepspeed="ds.json" if launcher else None))
    assert all(name not in os.environ for name in LAUNCH_VARIABLES if name != launcher)
