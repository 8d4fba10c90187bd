"""run.sh's launch flags (issue 22, item 4): torchrun's --nproc_per_node, --nnodes, --node_rank,
--master_addr, --master_port, msrun's --worker_num, --local_worker_num, --log_dir, `bash run.sh
FILE.yaml` and ASCEND_RT_VISIBLE_DEVICES, as msrun receives them; then two launches of run.sh in
two network namespaces making one job.

The translation is seen through a stand-in folder: a copy of run.sh whose .venv holds a `python`
and an `msrun` that only record their arguments (run.sh puts .venv/bin first on PATH), so nothing
trains and each case takes milliseconds.
"""
import hashlib
import os
import random
import shutil
import subprocess

import numpy as np
import pytest

import train
from test_all import HERE, PARALLEL_RUN, losses_of, shakespeare_bytes, train_lines

RECORDER = r'''#!/bin/sh
calls="$(dirname "$0")/../../calls"
printf '%s\t' "$(basename "$0")" "$@" >> "$calls"
echo >> "$calls"
'''


@pytest.fixture
def run_sh(tmp_path):
    """bash run.sh ARGS... in the stand-in folder: (the finished process, the recorded calls, each
    a list of its arguments after the program's name)."""
    folder = tmp_path / "project"
    (folder / ".venv" / "bin").mkdir(parents=True)
    for name in ("run.sh", "requirements.txt"):
        shutil.copy(os.path.join(HERE, name), folder / name)
    digest = hashlib.sha256((folder / "requirements.txt").read_bytes()).hexdigest()
    (folder / ".venv" / ".requirements.sha256").write_text(digest + "\n")      # set up already
    for program in ("python", "msrun"):
        (folder / ".venv" / "bin" / program).write_text(RECORDER)
        (folder / ".venv" / "bin" / program).chmod(0o755)

    def run(*args, **env):
        environ = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
        result = subprocess.run(["bash", str(folder / "run.sh"), *args], env=dict(environ, **env),
                                capture_output=True, text=True, timeout=60)
        calls = folder / "calls"
        recorded = [line.split("\t")[:-1] for line in calls.read_text().splitlines()] if calls.exists() else []
        calls.unlink(missing_ok=True)
        return result, recorded
    run.folder = folder
    return run


def msrun_args(workers, per_node, node_rank, addr, port, log_dir="output/msrun_log", train_args=()):
    return ["msrun", "--worker_num", str(workers), "--local_worker_num", str(per_node), "--node_rank", str(node_rank),
            "--master_addr", addr, "--master_port", str(port), "--log_dir", log_dir, "--join", "True",
            "--cluster_time_out", "300", "train.py", *train_args]


@pytest.mark.parametrize("form", ["--flag value", "--flag=value"])
def test_torchrun_flags_reach_msrun(run_sh, form):
    """The guides' DISTRIBUTED_ARGS: msrun gets nproc_per_node x nnodes workers in all, this node's
    share and rank, node 0's address and port; train.py's pre-check counts every worker."""
    flags = {"--nproc_per_node": "2", "--nnodes": "2", "--node_rank": "1", "--master_addr": "10.0.0.1",
             "--master_port": "6000", "--log_dir": "logs/node1"}
    argv = [a for flag, value in flags.items()
            for a in ([flag, value] if form == "--flag value" else [f"{flag}={value}"])]
    result, calls = run_sh(*argv, "--lr", "1e-3")
    assert result.returncode == 0, result.stderr
    assert calls == [["python", "train.py", "check", "--nproc", "4", "--lr", "1e-3"],
                     msrun_args(4, 2, 1, "10.0.0.1", 6000, "logs/node1", ["--lr", "1e-3"])]


def test_msrun_spellings_are_the_same_launch(run_sh):
    """--worker_num (all nodes) and --local_worker_num (this node) give the nodes; several nodes
    without --master_port use torchrun's 29500, so that every node agrees."""
    _, calls = run_sh("--worker_num", "4", "--local_worker_num", "2", "--node_rank", "0", "--master_addr", "10.0.0.1",
                      "--lr", "1e-3")
    assert calls[1] == msrun_args(4, 2, 0, "10.0.0.1", 29500, train_args=["--lr", "1e-3"])
    _, calls = run_sh("--worker_num", "3", "--lr", "1e-3")                 # alone: one node
    assert calls[0] == ["python", "train.py", "check", "--nproc", "3", "--lr", "1e-3"]
    assert calls[1][:8] == msrun_args(3, 3, 0, "127.0.0.1", 0)[:8]


def test_one_node_keeps_nproc_and_a_random_port(run_sh):
    _, calls = run_sh("--nproc", "3", "--lr", "1e-3")
    port = int(calls[1][10])
    assert calls[1] == msrun_args(3, 3, 0, "127.0.0.1", port, train_args=["--lr", "1e-3"])
    assert 8100 <= port < 8900
    _, calls = run_sh("--nproc_per_node", "1", "--nnodes", "1", "--lr", "1e-3")   # one worker: no msrun
    assert calls == [["python", "train.py", "--lr", "1e-3"]]


def test_a_yaml_file_first_is_the_config(run_sh):
    """`bash run.sh FILE.yaml`, as the MindSpore Transformers guide's `bash pretrain_gpt.sh
    xx.yaml`; a first argument that is no such file goes to train.py unchanged (its own error)."""
    for name in ("my.yaml", "my.yml"):
        (run_sh.folder / name).write_text("training_config:\n  train_iters: 5\n")
        _, calls = run_sh(name, "--lr", "1e-3")
        assert calls == [["python", "train.py", "--config", name, "--lr", "1e-3"]]
    _, calls = run_sh("--nproc", "2", "my.yaml")
    assert calls[0] == ["python", "train.py", "check", "--nproc", "2", "my.yaml"]
    _, calls = run_sh("missing.yaml")
    assert calls == [["python", "train.py", "missing.yaml"]]


def test_ascend_visible_devices_sets_the_workers_per_node(run_sh):
    """As the guide's script counts them; one line says so. A flag's count wins."""
    result, calls = run_sh("--lr", "1e-3", ASCEND_RT_VISIBLE_DEVICES="0,1,2,3")
    assert result.stdout.splitlines()[0] == ("bash run.sh: 4 workers per node, one per device in "
                                             "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 (on this CPU, the count alone)")
    assert calls[0] == ["python", "train.py", "check", "--nproc", "4", "--lr", "1e-3"]
    assert calls[1][:5] == ["msrun", "--worker_num", "4", "--local_worker_num", "4"]
    _, calls = run_sh("--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--lr", "1e-3",
                      ASCEND_RT_VISIBLE_DEVICES="0,1")
    assert calls[1] == msrun_args(4, 2, 1, "10.0.0.1", 29500, train_args=["--lr", "1e-3"])
    result, calls = run_sh("--nproc", "2", "--lr", "1e-3", ASCEND_RT_VISIBLE_DEVICES="0,1,2,3")
    assert "ASCEND" not in result.stdout and calls[1][2] == "2"
    _, calls = run_sh("--lr", "1e-3", ASCEND_RT_VISIBLE_DEVICES="0")
    assert calls == [["python", "train.py", "--lr", "1e-3"]]


BAD_LAUNCHES = [
    (["--nproc_per_node", "two"],
     "error: --nproc_per_node two: give the number of workers, a whole number from 1"),
    (["--nnodes=0"], "error: --nnodes 0: give the number of nodes, a whole number from 1"),
    (["--node_rank", "2", "--nnodes", "2", "--master_addr", "10.0.0.1"],
     "error: --node_rank 2: give this node's rank among --nnodes 2, a whole number from 0 to 1"),
    (["--node_rank", "1"],
     "error: --node_rank 1: give this node's rank among --nnodes 1, a whole number from 0 to 0"),
    (["--nnodes", "2", "--node_rank", "0"],
     "error: a job of 2 nodes needs --master_addr: node 0's address, the same on every node"),
    (["--nnodes", "2", "--master_addr", "10.0.0.1"],
     "error: a job of 2 nodes needs --node_rank: this node's rank, 0 to 1"),
    (["--master_port", "80"],
     "error: --master_port 80: give a port for msrun's scheduler, a whole number from 1024 to 65535"),
    (["--worker_num", "5", "--local_worker_num", "2"], "error: --worker_num 5 is not 2 workers per node x 2 nodes: "
     "every node runs as many workers (--worker_num = --local_worker_num x --nnodes)"),
    (["--lr", "1e-3", "--master_addr"],
     "error: --master_addr needs a value: --master_addr VALUE or --master_addr=VALUE"),
]


@pytest.mark.parametrize("argv,message", BAD_LAUNCHES, ids=[" ".join(a) for a, _ in BAD_LAUNCHES])
def test_a_bad_launch_is_one_line_before_anything_starts(run_sh, argv, message):
    result, calls = run_sh(*argv)
    assert (result.returncode, result.stderr.splitlines(), calls) == (2, [message], [])


def test_two_run_sh_launches_make_one_job(tmp_path):
    """The multi-node form through run.sh with torchrun's flags: two launches, --node_rank 0 and 1,
    join into one DP2 job whose losses equal one process's. The second "node" lives in its own
    network namespace (a veth pair, 10.213.0.1 <-> 10.213.0.2): msrun starts a scheduler wherever
    --master_addr is a local address, so two launches on one host's 127.0.0.1 would both try to
    bind it."""
    ns, host_if, node_if = f"gptnode{os.getpid()}", f"gpta{os.getpid() % 100000}", f"gptb{os.getpid() % 100000}"
    setup = [["ip", "netns", "add", ns], ["ip", "link", "add", host_if, "type", "veth", "peer", "name", node_if],
             ["ip", "link", "set", node_if, "netns", ns], ["ip", "addr", "add", "10.213.0.1/24", "dev", host_if],
             ["ip", "link", "set", host_if, "up"],
             ["ip", "netns", "exec", ns, "ip", "addr", "add", "10.213.0.2/24", "dev", node_if],
             ["ip", "netns", "exec", ns, "ip", "link", "set", node_if, "up"],
             ["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"]]
    out, one = tmp_path / "two_nodes", tmp_path / "one"
    args = ["--config", os.path.join(HERE, "config.yaml"), "--data-path", shakespeare_bytes(tmp_path), *PARALLEL_RUN]
    assert train.main([*args, "--save", str(one)]) == 0
    port = str(random.randint(8100, 8900))
    try:
        for cmd in setup:
            subprocess.run(cmd, check=True, capture_output=True)
        nodes = []
        for node in (0, 1):
            cmd = ["bash", os.path.join(HERE, "run.sh"), "--nproc_per_node", "1", "--nnodes", "2",
                   "--node_rank", str(node), "--master_addr", "10.213.0.1", "--master_port", port,
                   "--log_dir", str(tmp_path / f"node{node}"), *args, "--save", str(out)]
            with open(tmp_path / f"node{node}.console", "w") as console:
                nodes.append(subprocess.Popen((["ip", "netns", "exec", ns] if node else []) + cmd,
                                              stdout=console, stderr=subprocess.STDOUT))
        codes = [n.wait(timeout=300) for n in nodes]
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    assert codes == [0, 0], [(tmp_path / f"node{n}.console").read_text()[-2000:] for n in (0, 1)]
    assert "1 -> 0, 0, 1, 0" in (out / "log" / "rank_0" / "info.log").read_text()      # one grid, dp 2
    np.testing.assert_allclose(losses_of(train_lines(out)), losses_of(train_lines(one)), rtol=1e-5)
