"""What fdam-ray shows of a value or an address: credentials replaced by ``***``, big values shortened.

Every message, log line and printed address goes through :func:`redact` where it
may hold a URI or an address: a tracking URI (``MLFLOW_TRACKING_URI``), a
storage path (``s3://key:secret@bucket``), a Ray address (``ray://user:pw@host``)
or an error text that repeats one. Replaced are

- the password of a URI's user info (``scheme://user:PASSWORD@host``; a user info
  without a password that is as long as a token, ``https://TOKEN@host``, as a whole),
- the values of parameters whose names say they are secret (``?token=``, ``&sig=``,
  ``access_key=``, ``X-Amz-Signature=``, ``api_key=``, ...), and ``Bearer``/``Basic``
  credentials,
- any literal value of an environment variable whose name says it is secret
  (``WANDB_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``MLFLOW_TRACKING_PASSWORD``,
  ``RAY_AUTH_TOKEN``, ...) and the password of any URI held in the environment, wherever
  it appears (a library's error message may repeat it in another form).

:func:`short` is how an error message shows a value the user gave: a bounded
``repr`` (never the whole of a big or self-repeating value, such as a YAML alias
bomb), redacted, at most ``limit`` characters.
"""

from __future__ import annotations

import logging
import os
import re
import reprlib
from typing import Any
from urllib.parse import unquote

MASK = "***"

# scheme://user:password@  (the password runs to the last '@' before the path)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s'\"]*):(?P<secret>[^/\s'\"]*)@")
# scheme://token@  (a user info without a password: a token when it is this long)
_TOKEN_USER = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<secret>[^:/?#@\s'\"]{20,})@")
_SECRET_WORDS = (r"[\w.-]*(?:token|secret|passw(?:or)?d|pwd|signature|credential|api[_-]?key|access[_-]?key"
                 r"|private[_-]?key|account[_-]?key|auth)[\w.-]*")
# name=value anywhere in a text, for names that say they are secret
_SECRET_PARAM = re.compile(rf"(?i)(?<![\w.-])(?P<name>{_SECRET_WORDS})=(?P<secret>[^\s&'\",;)#]+)")
# short names that are secret only as a URI's query parameters (?sig=, &key=)
_QUERY_PARAM = re.compile(r"(?i)(?<=[?&;])(?P<name>sig|sas|key|code|sv_sig|se_sig)=(?P<secret>[^\s&'\"#]+)")
_BEARER = re.compile(r"(?i)\b(?P<name>bearer|basic)\s+(?P<secret>[A-Za-z0-9._~+/=-]{8,})")
_SECRET_VARIABLE = re.compile(r"(?i)(token|secret|passw(or)?d|pwd|api[_-]?key|access[_-]?key|credential"
                              r"|private[_-]?key|account[_-]?key|auth)")
_SETTING_WORDS = frozenset({"true", "false", "yes", "no", "none", "null", "disabled", "enabled", "token", "k8s",
                            "offline", "online", "auto", "password"})
_SHORTEST_LITERAL = 6  # environment values shorter than this are not replaced as literals (too many false hits)
_REDACT_MARGIN = 4096  # characters past what a shortened text shows that are still redacted before the cut


def _is_setting(value: str) -> bool:
    """A value of a secret-named variable that is no secret: a path, a mode (``RAY_AUTH_MODE=disabled``) or a
    placeholder in advice (``RAY_AUTH_TOKEN=<token>``, ``$WANDB_API_KEY``)."""
    return value.startswith(("/", "~", ".", "<", "$", "{")) or value.lower() in _SETTING_WORDS


def _masked_param(match: re.Match) -> str:
    if _is_setting(match["secret"]):
        return match[0]
    return f"{match['name']}={MASK}"


def _environment_secrets() -> list[str]:
    """Literal secrets the environment holds: values of secret-named variables, passwords of URIs in values."""
    found: set[str] = set()
    for name, value in os.environ.items():
        if not value:
            continue
        if _SECRET_VARIABLE.search(name) and not _is_setting(value):
            found.add(value)
        for match in _USERINFO.finditer(value):
            found.add(match["secret"])
        for pattern in (_SECRET_PARAM, _QUERY_PARAM, _TOKEN_USER):
            for match in pattern.finditer(value):
                found.add(match["secret"])
    forms = found | {unquote(s) for s in found}
    return sorted((s for s in forms if len(s) >= _SHORTEST_LITERAL), key=len, reverse=True)


def redact(text: Any) -> str:
    """``text`` (or a URI, an address, an exception) as a string with every credential replaced by ``***``."""
    out = str(text)
    out = _USERINFO.sub(lambda m: f"{m['head']}:{MASK}@", out)
    out = _TOKEN_USER.sub(lambda m: f"{m['head']}{MASK}@", out)
    out = _SECRET_PARAM.sub(_masked_param, out)
    out = _QUERY_PARAM.sub(lambda m: f"{m['name']}={MASK}", out)
    out = _BEARER.sub(lambda m: f"{m['name']} {MASK}", out)
    for secret in _environment_secrets():
        out = out.replace(secret, MASK)
    return out


def clip(text: Any, limit: int = 200) -> str:
    """A text for a message (a path, an error's own text): redacted, at most ``limit`` characters."""
    out = str(text)
    if len(out) > limit + _REDACT_MARGIN:  # redacting a huge text costs seconds; a URI straddling the cut is
        out = out[: limit + _REDACT_MARGIN]  # this far past what is shown
    out = redact(out)
    return out if len(out) <= limit else out[: max(limit - 3, 1)] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 3, 8, 8, 6, 8
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 200, 200, 60


def short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` as an error message shows it: bounded (a few levels, a few items, never expanded whole),
    redacted, at most ``limit`` characters; a long text says how long it is."""
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit, a self-containing value
        text = f"<a {type(value).__name__}>"
    text = redact(text)
    if len(text) > limit:
        text = text[: max(limit - 3, 1)] + "..."
    if isinstance(value, str) and len(value) > limit:
        text += f" ({len(value)} characters)"
    return text


class RedactingFilter(logging.Filter):
    """A handler filter that redacts each record's message (and drops its arguments, merged in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format: leave the record as it is; logging reports it
            return True
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:  # the traceback's text, redacted too
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def redact_handlers(logger: logging.Logger | None = None) -> None:
    """Add :class:`RedactingFilter` to the handlers of ``logger`` (the root logger by default), once each."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
