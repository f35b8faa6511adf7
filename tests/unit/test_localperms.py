"""What ckptfs leaves on the node is private, and its log holds no credentials, in process (through
real mounts: tests/mount/test_localperms_mount.py).

- The filter that masks credential values in log lines (ckptfs.logsafe.redact): the forms they
  take in headers, queries, config files and responses, masked; ordinary lines kept.
- The modes ckptfs gives what it creates: 0600 files and 0700 directories whatever the umask,
  set explicitly and only on its own files and directories (a FIFO or a symlink's target keeps
  its mode).
"""

from __future__ import annotations

import os

import pytest

from ckptfs.logsafe import redact
from tests.localperms_helpers import mode, umask


@pytest.mark.parametrize("line", [
    ("headers={'X-Amz-Security-Token': b'TOK', 'Authorization': b'AWS4-HMAC-SHA256 "
     "Credential=AKID/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=SIG'}"),
    "x-amz-security-token:TOK\nhost:127.0.0.1",
    "GET /b/k?X-Amz-Credential=AKID%2F2026&X-Amz-Security-Token=TOK&X-Amz-Signature=SIG HTTP",
    "Authorization: AWS4-HMAC-SHA256 Credential=AKID/x, Signature=SIG\r\nHost: s3",
    "[default]\naws_secret_access_key = TOK\naws_session_token=TOK",
    '{"AccessKeyId": "AKID", "SecretAccessKey": "TOK", "Token": "TOK", "Expiration": "x"}',
    "<Credentials><SecretAccessKey>TOK</SecretAccessKey><SessionToken>TOK</SessionToken>",
    "ReadOnlyCredentials(access_key='AKID', secret_key='TOK', token='TOK')",
])
def test_redact_masks_credential_values(line):
    out = redact(line)
    assert "TOK" not in out and "SIG" not in out and "***" in out, out


def test_redact_keeps_ordinary_lines_and_masks_literal_secrets():
    line = "commit 3: ck/step_100 (dcp), 4 files to upload; token bucket at 80%"
    assert redact(line) == line
    assert redact("got x-secret-value-123 back", ("x-secret-value-123",)) == "got *** back"


def test_modes_are_explicit_and_only_for_own_files_and_dirs(tmp_path):
    from cachemgr.host.nodefiles import make_dirs, open_private, restrict

    with umask(0):
        make_dirs(tmp_path / "a" / "b" / "c")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    with umask(0o277):  # would make a 0400 file
        os.close(open_private(tmp_path / "f", os.O_WRONLY))
    assert mode(tmp_path / "f") == 0o600
    # A FIFO (like a --log-file of /dev/stderr) and a symlink's target keep their modes.
    os.mkfifo(tmp_path / "fifo", 0o666)
    os.chmod(tmp_path / "fifo", 0o666)
    os.close(open_private(tmp_path / "fifo", os.O_RDWR))
    assert mode(tmp_path / "fifo") == 0o666
    (tmp_path / "target").write_bytes(b"")
    os.chmod(tmp_path / "target", 0o644)
    os.symlink("target", tmp_path / "link")
    restrict(tmp_path / "link", 0o600)
    assert mode(tmp_path / "target") == 0o644
    restrict(tmp_path / "target", 0o600)
    assert mode(tmp_path / "target") == 0o600
