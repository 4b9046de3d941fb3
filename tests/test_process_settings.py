"""Where a multi-process run's listeners (the coordinator, the transfer servers) bind: the
coordinator's host on process 0, this machine's address towards it elsewhere, or
``DORA_BIND_ADDRESS``; with explicit settings and with a scheduler's (no cluster needed)."""

from types import SimpleNamespace

import pytest

from dora_jax.distributed import process
from dora_jax.distributed.process import ENV_BIND, listen_host, route_to, spec_from

SCHEDULERS = [
    {"SLURM_NTASKS": "2"},
    {"OMPI_COMM_WORLD_SIZE": "2"},
    {"TPU_WORKER_HOSTNAMES": "t0,t1"},
]


def test_listen_host():
    far = lambda host: "10.1.0.9"  # noqa: E731  (this machine's address towards host)
    assert listen_host("10.1.0.5:8476", 0, route=far) == "10.1.0.5"
    assert listen_host("node07:8476", 0, route=far) == "node07"
    assert listen_host("10.1.0.5:8476", 1, route=far) == "10.1.0.9"
    assert listen_host("[fd00::5]:8476", 0) == "[fd00::5]"
    assert listen_host("10.1.0.5:8476", 1, "0.0.0.0", route=far) == "0.0.0.0"
    assert listen_host("127.0.0.1:8476", 1) == route_to("127.0.0.1") == "127.0.0.1"


@pytest.mark.parametrize("env", SCHEDULERS)
def test_a_scheduler_does_not_bind_to_every_interface(env):
    spec = spec_from(SimpleNamespace(), env)
    assert spec.auto and spec.bind is None  # listen_host decides once the scheduler is read
    assert spec_from(SimpleNamespace(), {**env, ENV_BIND: "0.0.0.0"}).bind == "0.0.0.0"


def test_explicit_settings_leave_the_bind_to_listen_host():
    env = {"DORA_COORDINATOR": "10.1.0.5:8476", "DORA_NUM_PROCESSES": "2", "DORA_PROCESS_ID": "1"}
    spec = spec_from(SimpleNamespace(), env)
    assert (spec.coordinator, spec.process_id, spec.bind) == ("10.1.0.5:8476", 1, None)
    assert spec_from(SimpleNamespace(), {**env, ENV_BIND: "10.1.0.9"}).bind == "10.1.0.9"


@pytest.mark.parametrize("pid, expected", [(0, "10.1.0.5"), (1, "10.1.0.9")])
def test_initialize_binds_a_schedulers_run_where_listen_host_says(monkeypatch, pid, expected):
    """SLURM's settings as jax finds them: the coordinator service and the transfer server bind
    to listen_host's address (jax's own default is every interface, ``[::]``)."""
    import jax
    from jax._src import clusters, distributed
    from jax.experimental import transfer

    jax.local_devices()  # the backend exists before the fake runtime client below
    calls = {}
    detect = lambda *a: ("10.1.0.5:8476", 2, pid, None)  # noqa: E731
    monkeypatch.setattr(clusters.ClusterEnv, "auto_detect_unset_distributed_params", detect)
    monkeypatch.setattr(process, "route_to", lambda host: "10.1.0.9")
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.update(init=(a, k)))

    def server(client, address, transport):
        calls["server"] = address
        return SimpleNamespace(address=lambda: address)

    monkeypatch.setattr(transfer, "start_transfer_server", server)
    kv = SimpleNamespace(key_value_set=lambda k, v, **o: calls.setdefault("kv", []).append((k, v)))
    monkeypatch.setattr(distributed.global_state, "client", kv)
    proc = process.initialize(spec_from(SimpleNamespace(), {"SLURM_NTASKS": "2"}))
    args, kwargs = calls["init"]
    assert args == ("10.1.0.5:8476", 2, pid)
    assert kwargs["coordinator_bind_address"] == f"{expected}:8476"
    assert calls["server"] == f"{expected}:0" and proc.bind == expected
    # its transfer server's address and its join token (the epoch of its messages)
    assert [k for k, _ in calls["kv"]] == [f"dora/addr/{proc.index}", f"dora/join/{proc.index}"]
    assert calls["kv"][1][1] == proc.token and len(proc.token) == 16


def test_the_local_launcher_tells_its_processes_its_flags(tmp_path):
    """Every process of ``--local-processes`` finds the launcher's flags (for its resume hint)."""
    from dora_jax.distributed.launcher import ENV_LAUNCH, launch_local

    entry = tmp_path / "entry.py"
    entry.write_text(f"import os\nprint('flags:', os.environ[{ENV_LAUNCH!r}])\n")
    run_dir = tmp_path / "run"
    assert launch_local(2, [], run_dir, devices_per_process=4, entry=entry) == 0
    for i in range(2):
        log = (run_dir / "logs" / f"process_{i}.log").read_text()
        assert "flags: --local-processes 2\n" in log
    assert launch_local(2, [], run_dir, devices_per_process=2, pin_cores=False, entry=entry) == 0
    log = (run_dir / "logs" / "process_1.log").read_text()
    assert "flags: --local-processes 2 --devices-per-process 2\n" in log
