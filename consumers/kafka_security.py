"""Kafka client security: the ``[security]`` config section as kafka-python options, and one
clear line for a connection that a secured cluster refused.

Every Kafka client panagg makes (the source's consumer and admin client, the dead-letter and
release producers) gets the same options from :func:`client_options`. Secrets are read when a
client is made, from a file (``security.password_file``) or an environment variable
(``security.password_env``); an inline ``security.password`` is refused unless the config also
sets ``security.allow_inline_password = true`` (then it is used with a warning, and never saved
in the state directory's ``config.json``). No secret is ever part of a log line or an error:
the lines here name the key to fix, never its value.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from contextlib import contextmanager

__all__ = [
    "PROTOCOLS",
    "MECHANISMS",
    "KafkaConnectError",
    "SecurityError",
    "client_options",
    "read_password",
    "diagnose_connect",
    "check_security",
    "redacted",
]

log = logging.getLogger("panagg.kafka")

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_SECRET_KEYS = ("password",)
_warned: set[str] = set()


class SecurityError(ValueError):
    """A ``[security]`` setting that cannot work, in one line naming the fix (no secret)."""


class KafkaConnectError(RuntimeError):
    """A secured cluster refused the connection; the message is one line naming the fix."""


def _sasl(sec: Mapping) -> bool:
    return sec["protocol"].startswith("SASL_")


def _tls(sec: dict) -> bool:
    return sec["protocol"] in ("SSL", "SASL_SSL")


def redacted(cfg: Mapping) -> dict:
    """``cfg`` with every secret value blanked (for files written next to the checkpoints)."""
    # a typed config (aggregator/service/settings.py) gives its plain form: lists, not tuples
    out = (
        cfg.to_dict()
        if hasattr(cfg, "to_dict")
        else {section: dict(values) for section, values in cfg.items()}
    )
    sec = out.get("security")
    if sec:
        for key in _SECRET_KEYS:
            if sec.get(key):
                sec[key] = ""
    return out


def check_security(sec: Mapping, env: dict | None = None) -> None:
    """Raise :class:`SecurityError` for a ``[security]`` section that cannot work: settings that
    the protocol does not use, a missing password source, files that are not there."""
    env = os.environ if env is None else env
    proto = sec["protocol"]
    if proto not in PROTOCOLS:
        raise SecurityError(
            f"security.protocol must be one of {', '.join(PROTOCOLS)}, got "
            f"{proto!r}; set it in the config file [security] or "
            "PANAGG_SECURITY_PROTOCOL"
        )
    sources = [k for k in ("password_file", "password_env", "password") if sec.get(k)]
    if _sasl(sec):
        if sec["sasl_mechanism"] not in MECHANISMS:
            raise SecurityError(
                f"security.protocol = {proto} needs security.sasl_mechanism, one "
                f"of {', '.join(MECHANISMS)} (got {sec['sasl_mechanism']!r}); "
                "ask the cluster's operator which one it enables"
            )
        if not sec["username"]:
            raise SecurityError(
                f"security.protocol = {proto} needs security.username (the SASL user)"
            )
        if not sources:
            raise SecurityError(
                f"security.protocol = {proto} needs the SASL password: set "
                "security.password_file (a file holding it) or "
                "security.password_env (the name of an environment variable "
                "holding it)"
            )
        if len(sources) > 1:
            raise SecurityError(
                f"the SASL password is given {len(sources)} ways "
                f"({', '.join('security.' + k for k in sources)}); keep one"
            )
        if sources == ["password"] and not sec["allow_inline_password"]:
            raise SecurityError(
                "security.password puts the secret in the configuration itself "
                "(config files and shell history get copied and shared); put it "
                "in a file (security.password_file) or an environment variable "
                "(security.password_env), or set security.allow_inline_password "
                "= true to insist"
            )
        read_password(sec, env)  # readable now, not at the first reconnect
    else:
        used = [k for k in ("sasl_mechanism", "username", *sources) if sec.get(k)]
        if used:
            raise SecurityError(
                f"security.{used[0]} is set but security.protocol = {proto} "
                "does not use SASL; set security.protocol = SASL_SSL (or "
                f"SASL_PLAINTEXT), or remove security.{used[0]}"
            )
    tls_files = [k for k in ("ca_file", "cert_file", "key_file", "key_password_file") if sec.get(k)]
    if tls_files and not _tls(sec):
        raise SecurityError(
            f"security.{tls_files[0]} is set but security.protocol = {proto} "
            "does not use TLS; set security.protocol = SSL or SASL_SSL, or "
            f"remove security.{tls_files[0]}"
        )
    for key in tls_files:
        path = sec[key]
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise SecurityError(
                f"security.{key} = {path} is not a readable file; give the path "
                "of the PEM file (readable by the user panagg runs as)"
            )
    if sec.get("key_file") and not sec.get("cert_file"):
        raise SecurityError(
            "security.key_file is set without security.cert_file; give the "
            "client certificate too (PEM)"
        )


def read_password(sec: Mapping, env: dict | None = None) -> str:
    """The SASL password from its configured source (a trailing newline of a file dropped)."""
    env = os.environ if env is None else env
    if sec.get("password_file"):
        path = sec["password_file"]
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read()
        except OSError as exc:
            raise SecurityError(
                f"security.password_file = {path} cannot be read "
                f"({exc.strerror}); give a file readable by the user panagg "
                "runs as"
            ) from None
        except UnicodeDecodeError:
            raise SecurityError(
                f"security.password_file = {path} is not UTF-8 text; write the "
                "password into it as text"
            ) from None
        value = value[:-1] if value.endswith("\n") else value
        value = value[:-1] if value.endswith("\r") else value
        if not value:
            raise SecurityError(
                f"security.password_file = {path} is empty; write the SASL password into it"
            )
        return value
    if sec.get("password_env"):
        name = sec["password_env"]
        value = env.get(name, "")
        if not value:
            raise SecurityError(
                f"security.password_env names the environment variable {name}, "
                "which is not set (or empty); export it in the service's "
                "environment (e.g. systemd EnvironmentFile=)"
            )
        return value
    return sec.get("password", "")


def client_options(sec: Mapping | None, env: dict | None = None) -> dict:
    """kafka-python keyword arguments for a ``[security]`` config section (empty for PLAINTEXT).
    Every Kafka client of the service takes these."""
    if not sec or sec["protocol"] == "PLAINTEXT":
        return {}
    check_security(sec, env)
    out: dict = {"security_protocol": sec["protocol"]}
    if _sasl(sec):
        out.update(
            sasl_mechanism=sec["sasl_mechanism"],
            sasl_plain_username=sec["username"],
            sasl_plain_password=read_password(sec, env),
        )
        if sec.get("password") and "inline" not in _warned:
            _warned.add("inline")
            log.warning(
                "the SASL password is inline in the configuration "
                "(security.allow_inline_password = true); prefer security.password_file "
                "or security.password_env"
            )
        if sec["protocol"] == "SASL_PLAINTEXT" and "cleartext" not in _warned:
            _warned.add("cleartext")
            log.warning(
                "security.protocol = SASL_PLAINTEXT: records%s cross the network "
                "unencrypted; use SASL_SSL outside a trusted network",
                " and the password" if sec["sasl_mechanism"] == "PLAIN" else "",
            )
    if _tls(sec):
        out["ssl_check_hostname"] = bool(sec["check_hostname"])
        if sec["ca_file"]:
            out["ssl_cafile"] = sec["ca_file"]
        if sec["cert_file"]:
            out["ssl_certfile"] = sec["cert_file"]
        if sec["key_file"]:
            out["ssl_keyfile"] = sec["key_file"]
        if sec["key_password_file"]:
            out["ssl_password"] = read_password({"password_file": sec["key_password_file"]}, env)
        if not sec["check_hostname"] and "hostname" not in _warned:
            _warned.add("hostname")
            log.warning(
                "security.check_hostname = false: the broker's certificate is not "
                "checked against its name (any holder of a certificate from the CA can "
                "pose as the broker)"
            )
    return out


# -- why a secured connection failed: kafka-python logs the cause and raises a timeout ----------
_CAUSES = (
    # (substring of the client's log line, the fix); first match wins
    (
        "SaslAuthenticationFailed",
        "SASL authentication failed for user {user!r} "
        "({mechanism}): the broker rejected the credentials; check security.username and the "
        "password in {password_source} (and that the user exists for {mechanism} on the cluster)",
    ),
    (
        "UnsupportedSaslMechanism",
        "the broker does not enable SASL mechanism {mechanism}; set "
        "security.sasl_mechanism to one the cluster enables (ask its operator)",
    ),
    (
        "Hostname mismatch",
        "the broker's TLS certificate is not valid for the name in "
        "source.bootstrap ({bootstrap}); connect by a name or address the certificate lists, or "
        "(only if you must) set security.check_hostname = false",
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        "the broker's TLS certificate is not signed by a CA that "
        "security.ca_file trusts ({ca}); set security.ca_file to the CA that signed the broker's "
        "certificate",
    ),
    (
        "ALERT_BAD_CERTIFICATE",
        "the broker rejected the client certificate (mutual TLS); set "
        "security.cert_file and security.key_file to a certificate the cluster's CA signed",
    ),
    (
        "ALERT_CERTIFICATE_REQUIRED",
        "the broker requires a client certificate (mutual TLS); set "
        "security.cert_file and security.key_file",
    ),
    (
        "ALERT_UNKNOWN_CA",
        "the broker does not trust the client certificate's CA; use a client "
        "certificate signed by the cluster's CA (security.cert_file, security.key_file)",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "the listener at {bootstrap} does not speak TLS; set "
        "security.protocol to the listener's protocol (PLAINTEXT or SASL_PLAINTEXT), or use the "
        "TLS listener's port",
    ),
    (
        "Invalid frame length",
        "the listener at {bootstrap} speaks another protocol than "
        "security.protocol = {protocol} (e.g. TLS, or SASL); set security.protocol to the "
        "listener's protocol",
    ),
)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._lock2 = threading.Lock()

    def emit(self, record):
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text += f" {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        except Exception:
            return
        with self._lock2:
            if len(self.lines) < 500:
                self.lines.append(text)


def _explain(lines: list[str], sec: dict | None, bootstrap: str) -> str | None:
    sec = sec or {}
    if sec.get("password_file"):
        where = f"security.password_file ({sec['password_file']})"
    elif sec.get("password_env"):
        where = f"the environment variable {sec['password_env']} (security.password_env)"
    else:
        where = "security.password"
    fields = {
        "user": sec.get("username", ""),
        "mechanism": sec.get("sasl_mechanism", ""),
        "password_source": where,
        "bootstrap": bootstrap,
        "ca": sec.get("ca_file") or "the system's CA store",
        "protocol": sec.get("protocol", "PLAINTEXT"),
    }
    joined = "\n".join(lines)
    for needle, text in _CAUSES:
        if needle in joined:
            return text.format(**fields)
    if _sasl({"protocol": sec.get("protocol", "PLAINTEXT")}) and "socket disconnected" in joined:
        # the broker answers a failed authentication and closes at once: the client often sees
        # only the close
        return (
            "the broker closed every connection during authentication: most likely the "
            "SASL credentials are wrong (check security.username and the password in "
            f"{fields['password_source']}) or security.sasl_mechanism ({fields['mechanism']}) "
            "is not enabled on this listener"
        )
    if (
        sec.get("protocol") == "SSL"
        and not sec.get("cert_file")
        and "socket disconnected" in joined
    ):
        return (
            "the broker closed every TLS connection: if it requires a client certificate "
            "(mutual TLS), set security.cert_file and security.key_file"
        )
    if sec.get("protocol", "PLAINTEXT") == "PLAINTEXT" and "socket disconnected" in joined:
        return (
            f"the broker at {bootstrap} closed every connection: if its listener is "
            "secured, set security.protocol (and the [security] settings it needs, "
            "docs/configuration.md)"
        )
    return None


@contextmanager
def diagnose_connect(sec: dict | None, bootstrap: str):
    """Run the body (which makes a Kafka client); if it raises a kafka-python error, and the
    client's own log lines show a security cause, raise :class:`KafkaConnectError` with one line
    naming the fix instead. The client's lines are captured (not shown) while the body runs."""
    logger = logging.getLogger("kafka")
    handler = _Capture()
    level, net = logger.level, logging.getLogger("kafka.net")
    net_level, net_propagate = net.level, net.propagate
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.WARNING, logging.WARNING))
    if net_level and net_level > logging.WARNING:  # the caller may have quietened it
        net.setLevel(logging.WARNING)
        net.propagate = False
        net.addHandler(handler)
    try:
        yield
    except Exception as exc:
        if not type(exc).__module__.startswith("kafka"):
            raise
        line = _explain(handler.lines, sec, bootstrap)
        if line is None:
            raise
        raise KafkaConnectError(f"cannot connect to Kafka at {bootstrap}: {line}") from None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        if net.level != net_level:
            net.removeHandler(handler)
            net.setLevel(net_level)
            net.propagate = net_propagate
