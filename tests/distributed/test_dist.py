"""Multi-node start-up: which launcher variables mean "several nodes", and the gloo address check.

gloo binds to the address the host name resolves to unless GLOO_SOCKET_IFNAME names an interface; on a
node whose name maps to 127.0.1.1 the other nodes cannot reach it ("Gloo connectFullMesh failed").
The check runs on real environment dicts with this machine's real resolver; the end-to-end tests start
`zerodp train` as one rank of a two-node job, and two DeepSpeed "nodes" through
launchers/multinode_deepspeed.sh.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import pytest

from tests.support.harness import ROOT, base_env, free_port
from zerodp.distributed.process_group import check_gloo_network, resolve_host, spans_several_nodes
from zerodp.errors import UserError

UNREACHABLE = "203.0.113.1"  # TEST-NET-3: nothing answers there
# Rank 2 of 4, two per node: the second node of a two-node job, as torchrun describes it.
SECOND_NODE = dict(RANK="2", LOCAL_RANK="0", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_ADDR=UNREACHABLE)
HOST_IS_LOOPBACK = [a for a in resolve_host(socket.gethostname())[:1] if a.startswith("127.") or a == "::1"]


def own_address() -> tuple[str, str] | None:
    """(interface, IPv4 address) of this machine's route outwards, read from the routing table."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((UNREACHABLE, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()))
            except OSError:
                continue
        if name != "lo" and socket.inet_ntoa(packed[20:24]) == local:
            return name, local
    return None


@pytest.mark.parametrize("env, several", [
    ({}, False),                                                                    # one plain process
    (dict(WORLD_SIZE="8", LOCAL_WORLD_SIZE="8"), False),                            # torchrun, one node
    (dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8"), True),                            # torchrun, two nodes
    (dict(WORLD_SIZE="8", LOCAL_SIZE="8", CROSS_SIZE="1"), False),                  # deepspeed launcher
    (dict(WORLD_SIZE="16", LOCAL_SIZE="8", CROSS_SIZE="2"), True),
    (dict(OMPI_COMM_WORLD_SIZE="16", OMPI_COMM_WORLD_LOCAL_SIZE="8"), True),        # mpirun
    (dict(OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_SIZE="8"), False),
    (dict(SLURM_NTASKS="16", SLURM_STEP_NUM_NODES="2", SLURM_NNODES="2"), True),    # srun
    (dict(SLURM_NTASKS="8", SLURM_STEP_NUM_NODES="1", SLURM_NNODES="2"), False),    # a one-node step
    (dict(WORLD_SIZE="2"), False),                                                  # cannot tell: no check
])
def test_which_launcher_environments_span_several_nodes(env, several):
    assert spans_several_nodes(env) is several


def test_loopback_host_name_on_several_nodes_names_the_variable():
    # "localhost" resolves to loopback everywhere, as a name mapped to 127.0.1.1 does on Debian hosts
    with pytest.raises(UserError, match=r"host name 'localhost' resolves to (127\.0\.0\.1|::1), a loopback address.*"
                                        r"connectFullMesh failed.*export GLOO_SOCKET_IFNAME=.*"
                                        r"MASTER_ADDR=203\.0\.113\.1"):
        check_gloo_network(SECOND_NODE, "localhost")
    with pytest.raises(UserError, match=r"host name 'no-such-host\.invalid' does not resolve, so gloo falls back "
                                        r"to 127\.0\.0\.1.*export GLOO_SOCKET_IFNAME="):
        check_gloo_network(SECOND_NODE, "no-such-host.invalid")


@pytest.mark.parametrize("change", [
    dict(LOCAL_WORLD_SIZE="4"),                            # every rank on this node
    dict(WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", RANK="0"),  # one process
    dict(MASTER_ADDR="127.0.0.1"),                         # "nodes" that are all this machine
    dict(MASTER_ADDR="localhost"),
    dict(GLOO_SOCKET_IFNAME="lo"),                         # the user chose the interface
])
def test_runs_the_check_leaves_alone(change):
    check_gloo_network(dict(SECOND_NODE, **change), "localhost")


def test_host_name_with_a_network_address_passes():
    found = own_address()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 route")
    check_gloo_network(SECOND_NODE, found[1])


def test_gloo_socket_ifname_naming_no_interface_is_an_error():
    interfaces = [name for _, name in socket.if_nameindex()]
    with pytest.raises(UserError, match=r"GLOO_SOCKET_IFNAME=lo,nosuch0 names no network interface on node-x "
                                        r"\(nosuch0; it has .*lo.*\); export GLOO_SOCKET_IFNAME with"):
        check_gloo_network({"GLOO_SOCKET_IFNAME": "lo,nosuch0"}, "node-x")
    check_gloo_network({"GLOO_SOCKET_IFNAME": ",".join(interfaces)}, "node-x")


def train(tiny, tmp_path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "zerodp", "train", "configs/tiny.yaml", *tiny, "train.max_steps=2",
           "strategy.name=ddp", f"train.out_dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(not HOST_IS_LOOPBACK, reason=f"this machine's host name {socket.gethostname()!r} does not "
                                                 f"resolve to a loopback address; the unit tests cover the check")
def test_rank_of_a_two_node_job_stops_before_connecting(tiny, tmp_path):
    """Rank 2 of 4, two per node, MASTER_ADDR unreachable: one line and exit 2 within seconds, instead of
    waiting strategy.timeout_s for a store or failing later in connectFullMesh."""
    env = dict(base_env(4), **SECOND_NODE)
    env.pop("GLOO_SOCKET_IFNAME", None)
    start = time.monotonic()
    r = train(tiny, tmp_path, env)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert (f"host name '{socket.gethostname()}' resolves to {HOST_IS_LOOPBACK[0]}, a loopback address"
            in r.stderr), r.stderr
    assert "export GLOO_SOCKET_IFNAME=" in r.stderr and "MASTER_ADDR=203.0.113.1" in r.stderr
    assert time.monotonic() - start < 45


def test_one_process_with_a_wrong_gloo_socket_ifname_is_one_line(tiny, tmp_path):
    env = base_env(1)
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        env.pop(k)
    r = train(tiny, tmp_path, dict(env, GLOO_SOCKET_IFNAME="nosuch0"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "GLOO_SOCKET_IFNAME=nosuch0 names no network interface" in r.stderr


# Stand-ins for the two programs DeepSpeed's pdsh runner calls, since no second node exists here: `ssh`
# (its connectivity check) succeeds; `pdsh -w a,b CMD` runs CMD for every host on this machine with %n
# replaced by the host's index, in an environment as bare as an ssh login's: only what DeepSpeed puts
# into CMD (its exports) reaches the ranks.
PDSH = r"""#!/usr/bin/env bash
while getopts "Sf:w:" o; do case $o in w) hosts=$OPTARG ;; *) ;; esac; done; shift $((OPTIND - 1))
IFS=, read -ra names <<<"$hosts"; pids=()
for i in "${!names[@]}"; do env -i HOME="$HOME" PATH="$PATH" bash -c "${*//%n/$i}" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""


def deepspeed_two_nodes(tiny, tmp_path, interface: str | None, address: str) -> subprocess.CompletedProcess:
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir(exist_ok=True)
    home.mkdir(exist_ok=True)
    for name, text in (("pdsh", PDSH), ("ssh", "#!/bin/sh\nexit 0\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    # The user's own ~/.deepspeed_env must still reach the ranks.
    cache = os.environ["ZERODP_CACHE"]
    (home / ".deepspeed_env").write_text(f"DS_ACCELERATOR=cpu\nZERODP_CACHE={cache}\nOMP_NUM_THREADS=1\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    env = dict(base_env(2), HOME=str(home), MASTER_ADDR=address, MASTER_PORT=str(free_port()),
               PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    for k in ("WORLD_SIZE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "DS_ENV_FILE"):
        env.pop(k, None)
    if interface:
        env["GLOO_SOCKET_IFNAME"] = interface
    cmd = ["bash", "launchers/multinode_deepspeed.sh", str(hostfile), "configs/tiny.yaml", *tiny,
           "train.max_steps=2", "strategy.name=ddp", "train.global_batch_size=8", f"train.out_dir={tmp_path / 'run'}"]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not HOST_IS_LOOPBACK, reason="this machine's host name does not resolve to loopback")
def test_deepspeed_launcher_forwards_gloo_socket_ifname_to_every_node(tiny, tmp_path):
    """Two "nodes" through launchers/multinode_deepspeed.sh with MASTER_ADDR this machine's network
    address: without GLOO_SOCKET_IFNAME the ranks stop with the one-line error; with it, the script
    hands it to DeepSpeed's runner (which forwards no GLOO_* variable by itself) and they train over
    that interface."""
    found = own_address()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 route")
    interface, address = found
    r = deepspeed_two_nodes(tiny, tmp_path, None, address)
    assert r.returncode == 2, (r.stdout + r.stderr)[-3000:]
    assert "zerodp: error: this run spans several nodes" in r.stderr and "export GLOO_SOCKET_IFNAME=" in r.stderr
    r = deepspeed_two_nodes(tiny, tmp_path, interface, address)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "on 2 process(es)" in r.stdout + r.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
