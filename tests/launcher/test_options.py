"""pollux-run's horovodrun-compatible flags: meaning, validation, one-line errors."""

import pytest

from pollux_launch.launcher.frameworks import detect_framework
from pollux_launch.launcher.hosts import Host, HostsError, parse_hostfile, parse_hosts
from pollux_launch.launcher.options import UNBOUNDED, OptionsError, parse_launch_args


def test_np_alone_is_fixed_like_horovodrun():
    o = parse_launch_args(["-np", "3", "python", "-c", "pass"])
    assert (o.np, o.min_np, o.max_np, o.elastic) == (3, 3, 3, False)
    assert o.command == ("python", "-c", "pass")


def test_elastic_range_and_defaults():
    o = parse_launch_args(["--min-np", "2", "--max-np", "8", "python", "t.py", "--lr", "1"])
    assert (o.np, o.min_np, o.max_np, o.elastic) == (2, 2, 8, True)
    assert o.command[-2:] == ("--lr", "1")  # the command's own flags are left alone
    o = parse_launch_args(["-np", "2", "--min-np", "1", "python"])
    assert (o.np, o.min_np, o.max_np) == (2, 1, UNBOUNDED)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-np", "5", "--max-np", "4", "python"], "-np 5 must lie within"),
        (["--min-np", "3", "--max-np", "2", "python"], "larger than --max-np"),
        (["-np", "0", "python"], "from 1 to"),
        (["-np", "2"], "no command given"),
        (["-np", "2", "no-such-command-xyz"], "not found"),
        (["--mpi", "python"], "--mpi is not supported"),
        (["-p", "22", "python"], "node agents, not ssh"),
        (["-H", "a:2,a:3", "python"], "listed twice"),
        (["-H", "a:0", "python"], "from 1 to"),
        (["-H", "a:1", "--hostfile", "x", "python"], "only one of"),
        (["--min-np", "4", "-H", "a:1,b:2", "python"], "needs more slots"),
        (["--fairness", "0", "python"], "not be 0"),
        (["--job-name", "Bad Name!", "python"], "--job-name"),
        (["--fusion-threshold-mb", "64", "--framework", "torch", "python"], "Horovod tuning"),
        (["--reset-limit", "3", "--framework", "torch", "python"], "horovodrun elastic"),
        (["--blacklist-cooldown-range", "1", "5", "--framework", "deepspeed", "python"],
         "horovodrun elastic"),
    ],
)
def test_bad_input_is_one_clear_line(argv, needle):
    with pytest.raises(OptionsError) as info:
        parse_launch_args(argv)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_horovod_tuning_flags_become_environment():
    o = parse_launch_args(["--fusion-threshold-mb", "2", "--autotune",
                           "--framework", "horovod", "python"])
    assert o.horovod_env == {"HOROVOD_FUSION_THRESHOLD": str(2 * 1024 * 1024),
                             "HOROVOD_AUTOTUNE": "1"}


def test_hosts_and_hostfile(tmp_path):
    assert parse_hosts("a:2,b", default_slots=4) == (Host("a", 2), Host("b", 4))
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=4\n\nnode2 slots=2  # small\nnode3\n")
    assert parse_hostfile(f) == (Host("node1", 4), Host("node2", 2), Host("node3", 1))
    f.write_text("node1 slots=four\n")
    with pytest.raises(HostsError, match=r"hosts:1: expected 'hostname slots=N'"):
        parse_hostfile(f)
    with pytest.raises(HostsError, match="cannot read"):
        parse_hostfile(tmp_path / "missing")


def test_framework_detection(tmp_path):
    (tmp_path / "hvd.py").write_text("import torch\nimport horovod.torch as hvd\n")
    (tmp_path / "ds.py").write_text("from deepspeed import initialize\n")
    (tmp_path / "plain.py").write_text("import torch  # mentions horovod in a comment\n")
    assert detect_framework(["python", "hvd.py"], tmp_path) == "horovod"
    assert detect_framework(["python", "ds.py"], tmp_path) == "deepspeed"
    assert detect_framework(["python", "plain.py"], tmp_path) == "torch"
    assert detect_framework(["python", "plain.py", "--deepspeed_config", "c.json"]) == "deepspeed"
    o = parse_launch_args(["python", "hvd.py"], cwd=tmp_path)
    assert o.framework == "horovod"


def test_checkpoint_flags_become_the_workers_environment(tmp_path):
    o = parse_launch_args(["--checkpoint-dir", "ck", "--checkpoint-interval", "5", "python"],
                          cwd=tmp_path)
    assert o.worker_env["POLLUX_CHECKPOINT_DIR"] == str(tmp_path / "ck")
    assert float(o.worker_env["POLLUX_CHECKPOINT_INTERVAL"]) == 5.0
    assert (tmp_path / "ck").is_dir()  # made before anything starts
    (tmp_path / "file").write_text("")
    for argv, needle in [
        (["--checkpoint-dir", "file/ck", "python"], "--checkpoint-dir file/ck: cannot write"),
        (["--checkpoint-interval", "5", "python"], "needs --checkpoint-dir"),
        (["--checkpoint-dir", "ck", "--checkpoint-interval", "0", "python"], "positive"),
        (["--checkpoint-dir", "ck", "--checkpoint-interval", "nan", "python"], "finite"),
    ]:
        with pytest.raises(OptionsError, match=needle):
            parse_launch_args(argv, cwd=tmp_path)
