"""The world's host list (`crossover.daemon.world.hosts`): Slurm's form and hostfiles,
against literal tables."""

from __future__ import annotations

import pytest

from crossover.daemon.world.hosts import expand, place_of, read_hostfile

EXPANDED = [
    ("a", ["a"]),
    ("a,b, c", ["a", "b", "c"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu[1-2]-ib,login", ["gpu1-ib", "gpu2-ib", "login"]),
    ("a:2,b:4,a", ["a", "b"]),  # horovodrun's slots dropped, each host once
    ("n[1-2]:4", ["n1", "n2"]),
    ("node1.cluster,node2.cluster", ["node1.cluster", "node2.cluster"]),
    ("a b\tc", ["a", "b", "c"]),  # as sinfo and scontrol print lists too
    ("gpu[01-02]\ncpu[1-2] , d", ["gpu01", "gpu02", "cpu1", "cpu2", "d"]),
]


@pytest.mark.parametrize(("spec", "hosts"), EXPANDED)
def test_a_host_list_expands_as_slurm_writes_it(spec, hosts):
    assert expand(spec) == hosts


BAD = [
    ("", "empty name"),
    ("a,,b", "empty name"),
    ("n[1-3", "'[' without its ']'"),
    ("n1-3]", "']' without its '['"),
    ("n[[1-2]]", "brackets inside brackets"),
    ("n[a-c]", "must hold numbers and ranges"),
    ("n[5-2]", "runs backwards"),
    ("n[1-99999999]", "over 65536 hosts"),
    ("a:x", "has slots 'x'"),
    ("a:4[1-2]", "has slots '4[1-2]'"),
    ("a:[1-2]", "has slots '[1-2]'"),
    ("n[\u0661-\u0663]", "must hold numbers and ranges"),  # digits, but not ASCII ones
    ("a[0-9999]b[0-9999]", "over 65536 hosts"),  # counted before any name is made
    ("n[1- 2]", "white space inside brackets"),
    ("a/b", "is no host name"),
]


@pytest.mark.parametrize(("spec", "says"), BAD)
def test_a_bad_host_list_is_refused_naming_the_problem(spec, says):
    with pytest.raises(ValueError, match="host list") as err:
        expand(spec)
    assert says in str(err.value)


def test_a_hostfile_reads_as_open_mpi_and_horovod_write_it(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1 slots=4\n\nnode2   # second\ngpu[01-02] slots=8\n"
                    "node1\n")
    assert read_hostfile(path) == ["node1", "node2", "gpu01", "gpu02"]


def test_a_bad_hostfile_names_the_file_and_line(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1\nnode[2-\n")
    with pytest.raises(ValueError, match=r"hosts, line 2: host list 'node\[2-'"):
        read_hostfile(path)
    path.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="names no host"):
        read_hostfile(path)
    with pytest.raises(ValueError, match="cannot read it"):
        read_hostfile(tmp_path / "missing")


def test_a_node_finds_its_place_or_is_told_which_name_to_use():
    assert place_of("n2", ["n1", "n2", "n3"]) == 1
    with pytest.raises(ValueError, match=r"do not name this node \(n9\); add it"):
        place_of("n9", ["n1", "n2"])
    with pytest.raises(ValueError, match="differs from this node's name only in its "
                                         "domain: write 'n1.cluster'"):
        place_of("n1.cluster", ["n1", "n2"])
