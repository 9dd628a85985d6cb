import subprocess

import pytest

from hpcdl.distributed.ranks.hostlist import HostlistError, expand_hostlist

CASES = [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("c[401-403,405],knl-[0001-0002]", ["c401", "c402", "c403", "c405", "knl-0001", "knl-0002"]),
    ("nid[00998-01001]", ["nid00998", "nid00999", "nid01000", "nid01001"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("a,b,c", ["a", "b", "c"]),
    ("n[1,3,5-6]", ["n1", "n3", "n5", "n6"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("c401-[01-02],c402-01", ["c401-01", "c401-02", "c402-01"]),
    ("frontera-c[101-102],login1", ["frontera-c101", "frontera-c102", "login1"]),
    ("n[7]", ["n7"]),
    ("  n[1-2] ", ["n1", "n2"]),
]


@pytest.mark.parametrize("expr,hosts", CASES)
def test_expands_like_slurm(expr, hosts):
    assert expand_hostlist(expr) == hosts


@pytest.mark.parametrize("expr,fragment", [
    ("", "empty"), ("n[1-", "unclosed"), ("n1-2]", "unmatched"), ("n[5-3]", "backwards"),
    ("n[a-b]", "bad range"), ("n[1],,m", "empty entry"), ("n[[1]]", "nested"),
])
def test_rejects_malformed_with_the_expression_named(expr, fragment):
    with pytest.raises(HostlistError, match=fragment):
        expand_hostlist(expr)


def test_big_cluster_order_and_count():
    hosts = expand_hostlist("c[001-448]")
    assert len(hosts) == 448 and hosts[0] == "c001" and hosts[-1] == "c448"


@pytest.mark.parametrize("expr,hosts", CASES)
def test_agrees_with_slurms_own_expansion(slurm, expr, hosts):
    out = subprocess.run(["scontrol", "show", "hostnames", expr.strip()], capture_output=True, text=True, check=True)
    assert out.stdout.split() == expand_hostlist(expr)
