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


def test_policy_modules_become_the_workers_environment_after_a_check(tmp_path):
    (tmp_path / "train.py").write_text("import pollux_launch.adapters.torch\n")
    (tmp_path / "mypols").mkdir()
    (tmp_path / "mypols" / "caps.py").write_text("raise SystemExit('never run here')\n")
    o = parse_launch_args(["--policy-module", "pollux", "--policy-module", "mypols.caps:Cap",
                           "python", "train.py"], cwd=tmp_path)
    assert o.worker_env["POLLUX_POLICIES"] == "pollux,mypols.caps:Cap"
    (tmp_path / "plain.py").write_text("print('no pollux here')\n")
    for argv, needle in [
        (["--policy-module", "os.system('rm')", "python", "train.py"], "give module:Class"),
        (["--policy-module", "mypols.nothere:P", "python", "train.py"], "no module"),
        (["--policy-module", "nosuchpkg_x:P", "python", "train.py"], "no module"),
        (["--policy-module", "mypols.caps:Cap", "python", "plain.py"], "does not use"),
    ]:
        with pytest.raises(OptionsError, match=needle) as info:
            parse_launch_args(argv, cwd=tmp_path)
        assert "\n" not in str(info.value)


# -- torchrun's form and the kinds of elasticity ---------------------------------------
def test_torchrun_form_means_what_torchrun_means(tmp_path):
    import sys

    (tmp_path / "train.py").write_text("import torch.distributed as dist\n")
    o = parse_launch_args(["--nproc-per-node", "2", "--nnodes", "1:3", "--max-restarts", "2",
                           "train.py", "--lr", "1"], cwd=tmp_path)
    assert o.command == (sys.executable, "-u", "train.py", "--lr", "1")
    assert (o.np, o.min_np, o.max_np) == (2, 2, 6)
    assert (o.elasticity, o.max_restarts) == ("restart", 2)
    assert o.elasticity_reason == "script does not use the pollux API"
    o = parse_launch_args(["--nproc_per_node=2", "--standalone", "train.py"], cwd=tmp_path)
    assert (o.np, o.min_np, o.max_np, o.elasticity) == (2, 2, 2, "fixed")
    o = parse_launch_args(["--nproc-per-node", "1", "-m", "pkg.train", "--x"], cwd=tmp_path)
    assert o.command == (sys.executable, "-u", "-m", "pkg.train", "--x")
    o = parse_launch_args(["--nnodes", "2", "--no-python", "python", "-c", "pass"], cwd=tmp_path)
    assert o.command == ("python", "-c", "pass") and o.np == 2
    o = parse_launch_args(["--nproc-per-node", "1", "--rdzv-backend", "etcd",
                           "--rdzv-endpoint", "10.0.0.1:2379", "--rdzv-id", "exp-1", "train.py"],
                          cwd=tmp_path)
    assert (o.store, o.job_name) == ("etcd://10.0.0.1:2379", "exp-1")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--nproc-per-node", "2", "-np", "2", "train.py"], "use one form"),
        (["--nnodes", "3:1", "train.py"], "MIN <= MAX"),
        (["--nnodes", "a", "train.py"], "give N or MIN:MAX"),
        (["--nproc-per-node", "two", "train.py"], "a number, auto, cpu or gpu"),
        (["--nproc-per-node", "1", "missing.py"], "not found"),
        (["--node-rank", "1", "train.py"], "node ranks are assigned"),
        (["--master_addr", "h", "train.py"], "makes no sense here"),
        (["--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "far:29400",
          "train.py"], "pollux-run agent"),
        (["--standalone", "--store", "etcd://h:1", "train.py"], "--standalone"),
        (["--host-discovery-script", "d.sh", "python", "train.py"], "not an executable file"),
        (["--host-discovery-script", "train.py", "-H", "localhost:2", "python", "train.py"],
         "only one of -H, --hostfile and --host-discovery-script"),
        (["--max-restarts", "2", "-np", "1", "python", "live.py"], "re-forms live"),
        (["--min-np", "1", "--max-np", "2", "python", "hvd.py"], "does not use hvd.elastic"),
    ],
)
def test_torchrun_and_elasticity_mistakes_are_one_line(tmp_path, argv, needle):
    (tmp_path / "train.py").write_text("import torch\n")
    (tmp_path / "live.py").write_text("import pollux_launch.adapters.torch as pollux\n")
    (tmp_path / "hvd.py").write_text("import horovod.torch as hvd\nhvd.init()\n")
    with pytest.raises(OptionsError) as info:
        parse_launch_args(argv, cwd=tmp_path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_elasticity_is_detected_from_the_script(tmp_path):
    (tmp_path / "plain.py").write_text("import torch.distributed as dist\n")
    (tmp_path / "live.py").write_text("from pollux_launch.adapters import torch as pollux\n")
    (tmp_path / "hvd.py").write_text(
        "import horovod.torch as hvd\n@hvd.elastic.run\ndef f(s): pass\n")
    (tmp_path / "hvdfixed.py").write_text("import horovod.torch as hvd\nhvd.init()\n")
    cases = {("plain.py", "2"): "restart", ("plain.py", "1"): "fixed",
             ("live.py", "2"): "live", ("live.py", "1"): "live",
             ("hvd.py", "2"): "live", ("hvdfixed.py", "1"): "fixed"}
    for (script, hi), kind in cases.items():
        o = parse_launch_args(["-np", "1", "--max-np", hi, "python", script], cwd=tmp_path)
        assert o.elasticity == kind, (script, hi)
    o = parse_launch_args(["--elasticity", "restart", "-np", "2", "python", "live.py"],
                          cwd=tmp_path)
    assert o.elasticity == "restart"


def test_deepspeed_scripts_get_local_rank_after_the_script():
    from pollux_launch.launcher.frameworks import insert_local_rank

    assert insert_local_rank(["python", "-u", "t.py", "--deepspeed_config", "c.json"], 1) == \
        ["python", "-u", "t.py", "--local_rank=1", "--deepspeed_config", "c.json"]
    assert insert_local_rank(["python", "-m", "pkg.t", "--x"], 0) == \
        ["python", "-m", "pkg.t", "--local_rank=0", "--x"]
    assert insert_local_rank(["python", "t.py", "--local_rank", "3"], 0) == \
        ["python", "t.py", "--local_rank", "3"]


# -- one definition of the spec's bounds -------------------------------------------------
def test_the_command_lines_bounds_are_the_specs_own():
    """Each flag that sets a field of the job's spec is held to the bounds its readers
    check (messages.JobSpec): the highest they accept passes, anything above is one line."""
    from pollux_launch.launcher.options import SPEC_FLAGS
    from pollux_launch.messages import JobSpec, field_range

    lo, hi = field_range(JobSpec, "stop_grace")
    assert parse_launch_args(["--restart-grace", str(hi), "-np", "1", "python"]
                             ).stop_grace == hi
    with pytest.raises(OptionsError, match=rf"^--restart-grace {hi + 0.5!r}: must lie in "
                                           rf"\[{lo:.0f}, {hi:.0f}\]$"):
        parse_launch_args(["--restart-grace", str(hi + 0.5), "-np", "1", "python"])
    lo, hi = field_range(JobSpec, "max_restarts")
    with pytest.raises(OptionsError, match=rf"--max-restarts {hi + 1:.0f}: must lie in"):
        parse_launch_args(["--max-restarts", str(int(hi) + 1), "-np", "2", "python"])
    assert SPEC_FLAGS["stop_grace"] == "--restart-grace"


def test_a_spec_no_reader_would_take_is_refused_before_the_store_is_touched(tmp_path):
    """The launcher checks its spec with the readers' own decoding (messages.checked):
    what slips past the flags' checks (here: a spec above the readers' size limit) is one
    line, and nothing is written - not even the store's file."""
    import dataclasses

    from pollux_launch.launcher.run import launch
    from pollux_launch.messages import MAX_VALUE_BYTES

    url = f"embedded://{tmp_path / 'store.db'}"
    opts = parse_launch_args(["--store", url, "-np", "1", "python", "-c", "pass"], cwd=tmp_path)
    too_big = dataclasses.replace(opts, command=(*opts.command, "#" * MAX_VALUE_BYTES))
    with pytest.raises(OptionsError, match=r"the job's spec: JobSpec: \d+ bytes, more than") \
            as info:
        launch(too_big)
    assert "\n" not in str(info.value) and "every reader would refuse" in str(info.value)
    out_of_bounds = dataclasses.replace(opts, stop_grace=4000.0)  # (past the flag's check)
    with pytest.raises(OptionsError, match=r"^--restart-grace: JobSpec.stop_grace: 4000.0 is "
                                           r"outside \[0, 3600\]"):
        launch(out_of_bounds)
    assert not (tmp_path / "store.db").exists()


def test_policy_names_come_from_the_registry_and_are_for_local_mode():
    from pollux_launch.policy import DEFAULT_POLICY, POLICIES

    assert parse_launch_args(["--policy", DEFAULT_POLICY, "python"]).policy == DEFAULT_POLICY
    with pytest.raises(OptionsError) as info:
        parse_launch_args(["--policy", "nope", "python"])
    assert all(name in str(info.value) for name in POLICIES)
    with pytest.raises(OptionsError, match="coordinator service's policy"):
        parse_launch_args(["--store", "etcd://127.0.0.1:2379", "--policy", DEFAULT_POLICY,
                           "python"])


def test_an_agents_address_is_an_ip_address_or_a_name_that_resolves():
    import argparse

    from pollux_launch.arguments import node_address

    for good in ("10.0.0.7", "::1", "fe80::1%eth0", "localhost"):
        assert node_address(good) == good
    for bad, needle in (("999.1.1.1", "neither"), ("a b", "neither"), ("10.0.0", "neither"),
                        ("-x.example", "neither"), ("no-such-host.invalid", "does not resolve")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            node_address(bad)
