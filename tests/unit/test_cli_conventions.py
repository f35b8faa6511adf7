"""The conventions a new user brings from mount-s3 and the AWS tools, and what they promise.

- Spellings: `--endpoint-url`, `--region`, `--profile`, `--force-path-style` on `ckptfs mount`,
  on the store tools and as fstab `-o` options; the older `--s3-*` spellings are aliases that
  parse to the same value. AWS_ENDPOINT_URL[_S3], AWS_REGION / AWS_DEFAULT_REGION and
  AWS_PROFILE are honoured, once: an option beats the environment, which beats the AWS config
  file (checked on the boto3 client ckptfs builds, and through a real mount).
- `--read-only` / `-o ro`, a ro kernel mount: tests/mount/test_cli_conventions_mount.py.
- `--allow-other` / `--allow-root`, `--uid` / `--gid`: who may use a root mount (a process
  running as nobody), and the owner `stat` shows.
- `ckptfs completion bash|zsh` and the man page come from the parser: every option of every
  subcommand is in each, docs/ckptfs.1 is what scripts/gen_man.py writes, and the bash script
  completes in a real bash.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ckptfs import cliref
from ckptfs.cli import build_parser, mount_parser
from ckptfs.config import s3_from_env
from ckptfs.mount import EXIT_USAGE
from ckptfs.mounthelper import translate
from tests.cli_helpers import _refused, one_line_error
from tests.conftest import REPO, Mount, run_cli

NOBODY = 65534
# (primary, alias, a value or None for a flag)
SPELLINGS = [
    ("--endpoint-url", "--s3-endpoint", "http://minio.example:9000"),
    ("--region", "--s3-region", "eu-west-3"),
    ("--profile", "--s3-profile", "ckpt"),
    ("--force-path-style", "--s3-path-style", None),
]


def _sub(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]  # type: ignore[union-attr]


def _with(flag: str, value: str | None) -> list[str]:
    return [flag] if value is None else [flag, value]


# ----------------------------------------------------------------------------------------------
# spellings


@pytest.mark.parametrize("new,old,value", SPELLINGS, ids=[s[0] for s in SPELLINGS])
@pytest.mark.parametrize("cmd", ["mount", "ls", "restore", "fsck"])
def test_new_spelling_and_old_alias_parse_the_same(cmd, new, old, value):
    base = {"mount": ["/mnt/x"], "ls": ["s3://b/p"], "restore": ["s3://b/p", "s", "/d"],
            "fsck": ["s3://b/p"]}[cmd]
    p = _sub(cmd)
    plain = vars(p.parse_args(base))
    got_new = vars(p.parse_args([*base, *_with(new, value)]))
    got_old = vars(p.parse_args([*base, *_with(old, value)]))
    assert got_new == got_old
    changed = {k for k in got_new if got_new[k] != plain[k]}
    assert len(changed) == 1 and got_new[changed.pop()] == (True if value is None else value)


@pytest.mark.parametrize("new,old,value", SPELLINGS, ids=[s[0] for s in SPELLINGS])
def test_fstab_option_and_its_old_spelling_mean_the_same(new, old, value):
    def o(flag: str) -> str:
        name = flag[2:].replace("-", "_")
        return name if value is None else f"{name}={value}"

    p = mount_parser()
    a = vars(p.parse_args(translate("none", "/mnt/x", [o(new)])[0][1:]))
    b = vars(p.parse_args(translate("none", "/mnt/x", [o(old)])[0][1:]))
    assert a == b and a != vars(p.parse_args(["/mnt/x"]))


def test_fstab_generic_and_access_options():
    p = mount_parser()
    argv, _ = translate("none", "/mnt/x", ["ro", "allow_root", "uid=1000", "gid=1001"])
    a = p.parse_args(argv[1:])
    assert (a.read_only, a.allow_root, a.uid, a.gid, a.allow_other) == (True, True, 1000,
                                                                       1001, None)
    assert p.parse_args(translate("none", "/m", ["allow_other", "rw"])[0][1:]).allow_other


def test_help_lists_each_alias_beside_its_primary():
    res = run_cli("mount", "--help")
    flat = " ".join(res.stdout.split())
    for new, old, value in SPELLINGS:
        meta = "" if value is None else " " + {"--endpoint-url": "URL", "--region": "REGION",
                                                "--profile": "PROFILE"}[new]
        assert f"{new}{meta}, {old}{meta}" in flat


@pytest.mark.parametrize("flag,env,want", [
    # endpoint: flag > AWS_ENDPOINT_URL_S3 > AWS_ENDPOINT_URL; region: flag > AWS_REGION >
    # AWS_DEFAULT_REGION
    ((None, None), {"AWS_ENDPOINT_URL": "http://g:1", "AWS_ENDPOINT_URL_S3": "http://s:1"},
     ("http://s:1", None)),
    ((None, None), {"AWS_ENDPOINT_URL": "http://g:1"}, ("http://g:1", None)),
    (("http://f:1", None), {"AWS_ENDPOINT_URL_S3": "http://s:1"}, ("http://f:1", None)),
    ((None, None), {"AWS_ENDPOINT_URL": "http://g:1",
                    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}, (None, None)),
    ((None, None), {"AWS_REGION": "eu-west-3", "AWS_DEFAULT_REGION": "us-east-1"},
     (None, "eu-west-3")),
    ((None, None), {"AWS_DEFAULT_REGION": "us-east-2"}, (None, "us-east-2")),
    ((None, "ap-south-1"), {"AWS_REGION": "eu-west-3"}, (None, "ap-south-1")),
    ((None, None), {}, (None, None)),
], ids=["endpoint-s3-first", "endpoint-global", "endpoint-flag", "endpoint-ignored",
        "region-aws-region-first", "region-default", "region-flag", "none"])
def test_s3_settings_precedence(flag, env, want):
    assert s3_from_env(*flag, environ=env) == want


def _client(monkeypatch, tmp_path, env: dict[str, str], *flags: str):
    """The boto3 client `ckptfs ls` would build from `flags` in environment `env` (with an AWS
    config file that says: profile ckpt, region sa-east-1, virtual-hosted addressing)."""
    from ckptfs import storetools

    cfg = tmp_path / "aws-config"
    cfg.write_text("[profile ckpt]\nregion = sa-east-1\ns3 =\n    addressing_style = virtual\n")
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    a = _sub("ls").parse_args(["s3://bkt/p", *flags])
    endpoint, region = s3_from_env(a.s3_endpoint, a.s3_region)
    from cachemgr.store.s3 import S3Options, S3Store

    store = S3Store(a.store, S3Options(endpoint_url=endpoint, region=region,
                                       path_style=a.s3_path_style, profile=a.s3_profile))
    assert storetools  # the tools build theirs the same way (storetools.Session)
    return store.client


def _url(client) -> str:
    return client.generate_presigned_url("get_object", Params={"Bucket": "bkt", "Key": "k"})


def test_boto3_client_gets_flag_over_env_over_config(monkeypatch, tmp_path):
    # environment only: AWS_ENDPOINT_URL and AWS_REGION (which botocore itself ignores)
    c = _client(monkeypatch, tmp_path, {"AWS_ENDPOINT_URL": "http://env.example:9000",
                                        "AWS_REGION": "eu-west-3",
                                        "AWS_DEFAULT_REGION": "us-east-1"})
    assert c.meta.region_name == "eu-west-3"
    assert _url(c).startswith("http://env.example:9000/bkt/k")  # botocore's auto style
    # the flags win over the environment; the old spellings too
    for ep, rg in (("--endpoint-url", "--region"), ("--s3-endpoint", "--s3-region")):
        c = _client(monkeypatch, tmp_path, {"AWS_ENDPOINT_URL": "http://env.example:9000",
                                            "AWS_REGION": "eu-west-3"},
                    ep, "http://flag.example:9000", rg, "ap-south-1", "--force-path-style")
        assert c.meta.region_name == "ap-south-1"
        assert _url(c).startswith("http://flag.example:9000/bkt/k")
    # AWS_PROFILE picks the config file's profile: its region and its addressing style (not
    # overridden by ckptfs when --force-path-style is not given; with it, path style)
    c = _client(monkeypatch, tmp_path, {"AWS_PROFILE": "ckpt",
                                        "AWS_ENDPOINT_URL_S3": "http://s3.example:9000"})
    assert c.meta.region_name == "sa-east-1"
    assert _url(c).startswith("http://bkt.s3.example:9000/k")
    c = _client(monkeypatch, tmp_path, {"AWS_PROFILE": "ckpt",
                                        "AWS_ENDPOINT_URL_S3": "http://s3.example:9000"},
                "--force-path-style")
    assert _url(c).startswith("http://s3.example:9000/bkt/k")
    c = _client(monkeypatch, tmp_path, {"AWS_REGION": "eu-north-1"}, "--profile", "ckpt")
    assert c.meta.region_name == "eu-north-1"  # the environment over the config file


def test_bad_endpoint_from_environment_is_a_usage_error(tmp_path):
    mp = tmp_path / "mp"
    mp.mkdir()
    res = subprocess.run([sys.executable, "-m", "ckptfs", "mount", str(mp), "--cache-dir",
                          str(tmp_path / "c"), "--store", "s3://b/p"], capture_output=True,
                         text=True, timeout=60, cwd=REPO,
                         env={**os.environ, "AWS_ENDPOINT_URL": "ftp://nowhere"})
    one_line_error(res, EXIT_USAGE, "--endpoint-url", "AWS_ENDPOINT_URL", "ftp://nowhere")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args,needle", [
    (["--allow-other", "--allow-root"], "exclude each other"),
    (["--uid", "alice"], "--uid"),
    (["--gid", "-1"], "--gid"),
    (["--uid", str(2 ** 32 - 1)], "--uid"),
], ids=["allow-both", "uid-name", "gid-negative", "uid-none"])
def test_bad_access_options(tmp_path, args, needle):
    mp = tmp_path / "mp"
    mp.mkdir()
    res = run_cli("mount", str(mp), "--cache-dir", str(tmp_path / "c"), *args)
    one_line_error(res, EXIT_USAGE, needle)


# ----------------------------------------------------------------------------------------------
# who may use the mount, and the owner it shows


@pytest.fixture
def shared_dir():
    """A directory every user can traverse (pytest's tmp_path is root-only)."""
    base = Path(tempfile.mkdtemp(prefix="ckptfs-conv-", dir="/tmp"))
    os.chmod(base, 0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                          user=NOBODY, group=NOBODY, extra_groups=[], env={"PATH": "/usr/bin:/bin",
                                                                           "LANG": "C"})


needs_root = pytest.mark.skipif(os.geteuid() != 0 and os.environ.get("CI") != "true",
                                reason="switching users needs root")


@needs_root
@pytest.mark.parametrize("opts,nobody_gets_in", [
    ([], True), (["--allow-other"], True), (["--allow-root"], False),
], ids=["root-default", "allow-other", "allow-root"])
def test_who_may_use_a_root_mount(shared_dir, opts, nobody_gets_in):
    m = Mount(shared_dir, "acc")
    try:
        m.start(*opts)
        (m.path / "f").write_bytes(b"hello")
        os.chmod(m.path / "f", 0o644)
        res = _as_nobody("cat", str(m.path / "f"))
        if nobody_gets_in:
            assert res.returncode == 0 and res.stdout == "hello", res.stderr
        else:
            assert res.returncode != 0 and "Permission denied" in res.stderr, res
        assert (m.path / "f").read_bytes() == b"hello"  # root always may
        assert m.status()["access"] == ("allow_root" if "--allow-root" in opts
                                        else "allow_other")
        m.stop()
    finally:
        m.cleanup()


@needs_root
def test_uid_gid_is_the_owner_every_inode_shows(shared_dir):
    m = Mount(shared_dir, "own")
    try:
        m.start()
        (m.path / "mine").write_bytes(b"root's")
        m.stop()
        m.start("--uid", str(NOBODY), "--gid", str(NOBODY))
        for p in (m.path, m.path / "mine"):
            st = os.stat(p)
            assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p
        # the kernel checks against it: nobody owns the root directory now, so it may create
        res = _as_nobody("sh", "-c", f"echo hi > {m.path}/by-nobody && cat {m.path}/mine")
        assert res.returncode == 0 and res.stdout == "root's", res.stderr
        assert _refused(os.chown, m.path / "mine", 0, -1) == errno.EPERM
        assert _refused(os.chown, m.path / "mine", -1, 0) == errno.EPERM
        os.chown(m.path / "mine", NOBODY, NOBODY)  # to the mount's owner: a no-op
        assert m.status()["owner"] == {"uid": NOBODY, "gid": NOBODY}
        m.stop()
        # without the options each inode shows its own owner again, its creator's (Mount.start
        # with no arguments would repeat the last ones)
        m.start("--log-level", "info")
        assert os.stat(m.path / "mine").st_uid == 0
        assert os.stat(m.path / "by-nobody").st_uid == NOBODY
        m.stop()
    finally:
        m.cleanup()


# ----------------------------------------------------------------------------------------------
# completion and the man page


def _all_options() -> dict[str, list[str]]:
    _top, cmds = cliref.walk(build_parser())
    return {c.name: [f for o in c.options for f in o.flags] for c in cmds}


def test_man_page_is_what_the_parser_gives():
    page = (REPO / "docs" / "ckptfs.1").read_text()
    assert page == cliref.man(build_parser()), "run scripts/gen_man.py"
    # and the same from the script, in another user's environment and terminal width
    env = {**os.environ, "HOME": "/nonexistent", "XDG_CACHE_HOME": "/x", "XDG_DATA_HOME": "/y",
           "COLUMNS": "40"}
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_man.py"), "--check"],
                         capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert res.returncode == 0, res.stderr
    res = run_cli("man")
    assert res.returncode == 0 and res.stdout == page


def test_every_option_is_in_the_man_page_and_the_completions():
    page = (REPO / "docs" / "ckptfs.1").read_text()
    bash_s = run_cli("completion", "bash").stdout
    zsh_s = run_cli("completion", "zsh").stdout
    opts = _all_options()
    assert {"mount", "ls", "restore", "fsck", "completion", "man"} <= set(opts)
    for cmd, flags in opts.items():
        assert f'.SS "ckptfs {cmd} ' in page
        assert f"        {cmd})" in bash_s and f"            {cmd})" in zsh_s
        for flag in flags:
            assert f"\\fB{flag.replace('-', chr(92) + '-')}\\fR" in page, (cmd, flag)
            assert f" {flag} " in f" {bash_s.replace(chr(34), ' ')} ", (cmd, flag)
            assert flag in zsh_s, (cmd, flag)
    # the parser's own count: every action of every subparser, none left out
    for name, flags in opts.items():
        sp = _sub(name)
        want = {f for a in sp._actions if a.option_strings and a.help != "==SUPPRESS=="
                for f in a.option_strings} - {"-h", "--help"}
        assert set(flags) == want, name


def _complete(script: Path, *words: str) -> list[str]:
    """What bash's completion function offers for the command line `words` (the last being
    the word under the cursor), driven through COMP_WORDS/COMP_CWORD as readline does."""
    line = " ".join(words)
    arr = " ".join(f"'{w}'" for w in words)
    prog = (f"source {script}\nCOMP_WORDS=({arr})\nCOMP_CWORD={len(words) - 1}\n"
            f"COMP_LINE='{line}'\nCOMP_POINT={len(line)}\n_ckptfs\n"
            'printf "%s\\n" "${COMPREPLY[@]}"\n')
    res = subprocess.run(["bash", "--norc", "--noprofile", "-c", prog], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return [w for w in res.stdout.splitlines() if w]


def test_bash_completion_in_a_real_bash(tmp_path):
    if shutil.which("bash") is None:
        pytest.fail("bash missing")
    script = tmp_path / "ckptfs.bash"
    script.write_text(run_cli("completion", "bash").stdout)
    assert _complete(script, "ckptfs", "mo") == ["mount"]
    assert set(_complete(script, "ckptfs", "")) >= {"mount", "umount", "status", "completion"}
    assert _complete(script, "ckptfs", "mount", "--endp") == ["--endpoint-url"]
    assert _complete(script, "ckptfs", "mount", "/mnt/x", "--s3-e") == ["--s3-endpoint"]
    assert sorted(_complete(script, "ckptfs", "mount", "--read")) == ["--read-ahead-kb",
                                                                     "--read-only"]
    assert _complete(script, "ckptfs", "mount", "--log-level", "w") == ["warning"]
    assert _complete(script, "ckptfs", "mount", "--log-level", "=", "de") == ["debug"]
    assert _complete(script, "ckptfs", "mount", "--compress", "") == ["auto", "lz4", "off"]
    assert _complete(script, "ckptfs", "completion", "") == ["bash", "zsh"]
    assert _complete(script, "ckptfs", "ls", "--forc") == ["--force-path-style"]
    # a path argument completes file names
    (tmp_path / "ckpt-dir").mkdir()
    assert _complete(script, "ckptfs", "umount", str(tmp_path / "ckpt-d")) == [
        str(tmp_path / "ckpt-dir")]
    assert _complete(script, "ckptfs", "mount", "--uid", "") == []  # a number: nothing offered


def test_control_requests_are_judged_by_the_owner_uid_gid_report(tmp_path):
    """With --uid/--gid, `ckptfs commit` (and status, wait, prefetch) judge a caller by the
    owner `stat` shows it, not by the one recorded in the cache (ckptfs.daemon.OwnedIndex)."""
    from cachemgr.core.errors import FsError
    from cachemgr.core.index import Index
    from ckptfs.control import WRITE, Peer, check_access
    from ckptfs.daemon import OwnedIndex

    index = Index.open(tmp_path / "index.sqlite", uid=0, gid=0)  # root dir: root's, 0755
    trainer = Peer(pid=1, uid=NOBODY, gid=NOBODY, groups=frozenset())
    with pytest.raises(FsError) as e:
        check_access(index, trainer, "", WRITE)
    assert e.value.errno == errno.EACCES
    check_access(OwnedIndex(index, NOBODY, None), trainer, "", WRITE)  # owner: may write
    with pytest.raises(FsError):
        check_access(OwnedIndex(index, None, NOBODY), trainer, "", WRITE)  # group: r-x only
    index.close()
