"""The entry points' restart with huge pages for XLA:CPU's buffers (a3po_jax.cli.huge_pages).

The decision is a pure function of the environment, the kernel's THP mode and the glibc
version (tested as a table); the restart itself and its effect (2 MiB pages backing a large
allocation) are tested in a child interpreter where this machine supports them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from a3po_jax.cli import huge_pages as hp

SUPPORTED = dict(thp="madvise", glibc=(2, 36))


def test_restart_env_adds_the_tunable_and_the_marker():
    env = hp.huge_page_env({"PATH": "/bin"}, **SUPPORTED)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": hp.ENABLE, hp.RESTARTED_ENV: "1"}


def test_restart_env_keeps_the_users_other_tunables():
    env = hp.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **SUPPORTED)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{hp.ENABLE}"


@pytest.mark.parametrize(
    "environ, thp, glibc, why",
    [
        ({hp.OPT_OUT_ENV: "0"}, "madvise", (2, 36), "opted out"),
        ({hp.OPT_OUT_ENV: "off"}, "madvise", (2, 36), "opted out (word)"),
        ({hp.RESTARTED_ENV: "1"}, "madvise", (2, 36), "restarted already"),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), "user's choice"),
        ({"GLIBC_TUNABLES": "a=1:glibc.malloc.hugetlb=2"}, "always", (2, 36), "user's choice"),
        ({}, "never", (2, 36), "huge pages off in the kernel"),
        ({}, None, (2, 36), "no THP (not Linux)"),
        ({}, "madvise", (2, 34), "glibc without the tunable"),
        ({}, "madvise", None, "not glibc"),
    ],
)
def test_no_restart_where_it_cannot_help_or_is_not_wanted(environ, thp, glibc, why):
    assert hp.huge_page_env(environ, thp=thp, glibc=glibc) is None, why


def test_restart_in_always_mode_and_on_newer_glibc():
    assert hp.huge_page_env({}, thp="always", glibc=(2, 35)) is not None
    assert hp.huge_page_env({}, thp="madvise", glibc=(3, 0)) is not None


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert hp.thp_mode(path) == "madvise"
    path.write_text("[always] madvise never\n")
    assert hp.thp_mode(path) == "always"
    assert hp.thp_mode(tmp_path / "missing") is None


# A child that restarts itself, then mallocs and touches 512 MiB (malloc -> mmap, as XLA:CPU
# allocates its buffers; not numpy, which asks for huge pages itself) and reports its
# environment and how much of that block sits in 2 MiB pages.
CHILD = textwrap.dedent(
    """
    import ctypes, json, os
    from a3po_jax.cli import huge_pages as hp
    hp.reexec_with_huge_pages()
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    size = 512 * 2**20
    before = hp.anon_huge_page_bytes() or 0
    block = libc.malloc(ctypes.c_size_t(size))
    ctypes.memset(block, 1, size)
    after = hp.anon_huge_page_bytes() or 0
    checksum = sum(ctypes.c_uint8.from_address(block + i).value for i in range(0, size, 2**20))
    libc.free(ctypes.c_void_p(block))
    print(json.dumps({
        "tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "restarted": os.environ.get(hp.RESTARTED_ENV, ""),
        "huge_page_bytes": after - before,
        "checksum": checksum,
    }))
    """
)


def _child(**env_overrides) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hp.RESTARTED_ENV)}
    env.update(env_overrides)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _supported() -> bool:
    return hp.huge_page_env({}, thp=hp.thp_mode(), glibc=hp.glibc_version()) is not None


def test_child_restarts_with_the_tunable_once_where_supported():
    got = _child()
    assert got["checksum"] == 512  # the same program ran to the end
    if _supported():
        assert got["tunables"].split(":").count(hp.ENABLE) == 1
        assert got["restarted"] == "1"
    else:
        assert hp.ENABLE not in got["tunables"].split(":")


def test_opting_out_keeps_the_process_as_it_is():
    got = _child(**{hp.OPT_OUT_ENV: "0"})
    assert got["tunables"] == "" and got["restarted"] == ""


@pytest.mark.skipif(
    not _supported() or hp.thp_mode() != "madvise",
    reason="needs glibc >= 2.35 and transparent huge pages in madvise mode",
)
def test_the_restarted_process_gets_2mib_pages_and_an_opted_out_one_does_not():
    # In madvise mode only memory that asks for huge pages gets them: the tunable is what
    # makes the difference (khugepaged may still collapse a little later: allow 16 MiB).
    assert _child()["huge_page_bytes"] >= 256 * 2**20
    assert _child(**{hp.OPT_OUT_ENV: "0"})["huge_page_bytes"] <= 16 * 2**20


def test_the_cli_restarts_only_when_run_as_a_program(monkeypatch, capsys):
    from a3po_jax.cli import train

    calls = []
    monkeypatch.setattr(hp, "reexec_with_huge_pages", lambda: calls.append(1))
    experiment = str(Path(__file__).parents[1] / "experiments" / "quickstart_a3po.py")
    assert train.main(["--print-config", experiment]) == 0
    assert calls == []  # called as a function (tests, notebooks): the process is left alone
    first = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(sys, "argv", ["a3po-train", "--print-config", experiment])
    assert train.main() == 0
    assert calls == [1]
    assert json.loads(capsys.readouterr().out) == first  # and then ran as before
