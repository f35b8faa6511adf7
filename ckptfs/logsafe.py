"""Keeping credentials out of the daemon's log, whatever --log-level says.

Two layers:

1. `cap_aws_loggers`: botocore, boto3, s3transfer and urllib3 log at most INFO unless the
   environment variable CKPTFS_LOG_AWS_DEBUG=1 asks for their debug output. At DEBUG, botocore
   logs every request's headers (Authorization, X-Amz-Security-Token), its canonical request
   (the token again) and response bodies (temporary credentials from STS or the instance
   metadata service); `--log-level debug` is for ckptfs's own decisions.
2. `RedactSecrets`, a filter on the daemon's log handler: in every record (message, arguments
   and traceback), the value of anything named like a credential (Authorization,
   X-Amz-Security-Token, X-Amz-Credential, X-Amz-Signature, aws_secret_access_key,
   aws_session_token, SecretAccessKey, SessionToken, Token in JSON/XML) becomes `***`, and so
   does any literal occurrence of the secret key or session token in the daemon's environment.
   It applies to the opted-in AWS debug output too.
"""

from __future__ import annotations

import logging
import os
import re

AWS_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")
OPT_IN_ENV = "CKPTFS_LOG_AWS_DEBUG"
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
MASK = "***"

_NAMES = (r"authorization|x-amz-security-token|x-amz-credential|x-amz-signature"
          r"|aws_secret_access_key|aws_session_token|aws_security_token|secret_access_key"
          r"|secretaccesskey|session_?token|security_?token|secret_?key")
_KEY = rf"(?:{_NAMES})|(?<![\w-])token(?![\w-])"  # "token" alone, not "tokenizer"
_PATTERNS = (
    # A quoted value, as in a dict repr or JSON: 'Authorization': b'AWS4-HMAC-SHA256 ...'
    re.compile(rf"(?i)((?:{_KEY})[\"']?\s*[:=]\s*b?)([\"'])(?:\\.|(?!\2).)*\2"),
    # An Authorization header on its own line: up to the end of the line.
    re.compile(r"(?i)(authorization\s*:\s*)()(?![b]?[\"'])[^\r\n\"'\\]+"),
    # key=value in a query string or a config file, key:value in a canonical request.
    re.compile(rf"(?i)((?:{_KEY})\s*[:=]\s*)()(?!b?[\"'])[^\s&\"',;<>\\]+"),
    # XML: <SecretAccessKey>...</SecretAccessKey>
    re.compile(rf"(?i)(<(?:{_KEY})>)()[^<]*"),
)


# Every pattern above needs one of these words: one cheap search spares most records the rest.
_TRIGGER = re.compile(r"(?i)authorization|amz-|secret|token")


def redact(text: str, literals: tuple[str, ...] = ()) -> str:
    """`text` with every credential value masked (see the module docstring)."""
    for lit in literals:
        if lit in text:
            text = text.replace(lit, MASK)
    if not _TRIGGER.search(text):
        return text
    for pat in _PATTERNS:
        text = pat.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}{m.group(2)}", text)
    return text


def _env_secrets() -> tuple[str, ...]:
    # Short values ("testing") would mask ordinary words; real secrets are 40+ characters.
    return tuple(v for v in (os.environ.get(k, "") for k in SECRET_ENV) if len(v) >= 8)


class RedactSecrets(logging.Filter):
    """Masks credentials in each record before any handler formats it (the record is changed
    in place: message and arguments become one string, a traceback its redacted text)."""

    def __init__(self, literals: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.literals = _env_secrets() if literals is None else literals

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg = redact(record.getMessage(), self.literals)
            record.args = None
            if record.exc_info and not record.exc_text:
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            if record.exc_text:
                record.exc_text = redact(record.exc_text, self.literals)
            if record.stack_info:
                record.stack_info = redact(record.stack_info, self.literals)
        except Exception:  # noqa: BLE001, S110 - a bad format string: the handler reports it
            pass
        return True


def cap_aws_loggers(level: int) -> None:
    """AWS libraries log at `level` but never below INFO, unless CKPTFS_LOG_AWS_DEBUG=1."""
    if os.environ.get(OPT_IN_ENV) == "1":
        return
    for name in AWS_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.INFO, level))
