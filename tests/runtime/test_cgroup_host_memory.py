"""The host-memory plan's default size (issue 50 item 4): the job's cgroup memory limit when one is set, else the
machine's RAM. cgroup v2 ``memory.max`` ("max" = none; the smallest limit from the process's cgroup up to the mount),
cgroup v1 ``memory/memory.limit_in_bytes`` (its "no limit" is a page-rounded 2^63 - 1: above the RAM), read from
files written here in the layout the kernel mounts (Documentation/admin-guide/cgroup-v2.rst, cgroup-v1/memory.rst)."""

from pathlib import Path

from megamu.runtime.host_memory import cgroup_memory_limit, host_memory_bytes

GIB = 2**30
RAM = 2048 * GIB


def tree(tmp_path: Path, files: dict[str, str], proc: str) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    (tmp_path / "proc_cgroup").write_text(proc)
    return str(root), str(tmp_path / "proc_cgroup")


def test_v2_limit_of_the_process_cgroup(tmp_path):
    root, proc = tree(tmp_path, {"memory.max": "max", "job.slice/job_7/memory.max": str(900 * GIB)},
                      "0::/job.slice/job_7\n")
    assert cgroup_memory_limit(root, proc) == 900 * GIB
    assert host_memory_bytes(root, proc, ram=RAM) == 900 * GIB


def test_v2_a_parent_limit_applies_and_the_smallest_wins(tmp_path):
    root, proc = tree(tmp_path, {"job.slice/memory.max": str(700 * GIB), "job.slice/job_7/memory.max": "max"},
                      "0::/job.slice/job_7\n")
    assert cgroup_memory_limit(root, proc) == 700 * GIB


def test_v2_max_everywhere_is_no_limit_and_the_ram_counts(tmp_path):
    root, proc = tree(tmp_path, {"memory.max": "max", "a/memory.max": "max"}, "0::/a\n")
    assert cgroup_memory_limit(root, proc) is None
    assert host_memory_bytes(root, proc, ram=RAM) == RAM


def test_v2_a_container_sees_its_own_limit_at_the_mount(tmp_path):
    # /proc/self/cgroup names the host's path, which the container's mount does not have: its root file is read
    root, proc = tree(tmp_path, {"memory.max": str(512 * GIB)}, "0::/kubepods/pod1/abc\n")
    assert cgroup_memory_limit(root, proc) == 512 * GIB


def test_v1_limit_and_its_unlimited_value(tmp_path):
    root, proc = tree(tmp_path, {"memory/slurm/uid_0/job_3/memory.limit_in_bytes": str(256 * GIB)},
                      "12:pids:/slurm\n4:memory:/slurm/uid_0/job_3\n1:name=systemd:/\n")
    assert cgroup_memory_limit(root, proc) == 256 * GIB
    unlimited = str(9223372036854771712)  # what v1 shows without a limit
    root, proc = tree(tmp_path / "u", {"memory/memory.limit_in_bytes": unlimited}, "4:cpu,memory:/\n")
    assert cgroup_memory_limit(root, proc) == 9223372036854771712
    assert host_memory_bytes(root, proc, ram=RAM) == RAM  # above the RAM: the RAM


def test_no_cgroup_files_is_the_ram(tmp_path):
    assert cgroup_memory_limit(str(tmp_path / "none"), str(tmp_path / "none_proc")) is None
    assert host_memory_bytes(str(tmp_path / "none"), str(tmp_path / "none_proc"), ram=RAM) == RAM
