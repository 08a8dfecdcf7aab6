"""The [security] config section without a broker: what is refused (one line, no secret), what
kafka-python gets, and that secrets never reach the saved config (tests/integration/
test_kafka_security.py runs the same against a secured real broker)."""

import os
import subprocess
import sys

import pytest

from aggregator.service.config import ConfigError, load_config
from consumers.kafka_security import client_options, redacted

SECRET = "s3cr3t-Hunter2-do-not-print"


@pytest.fixture
def pw_file(tmp_path):
    path = tmp_path / "pw"
    path.write_text(SECRET + "\n")
    return str(path)


def sasl(pw_file, *more):
    return [
        "security.protocol=SASL_SSL",
        "security.sasl_mechanism=SCRAM-SHA-256",
        "security.username=svc",
        f"security.password_file={pw_file}",
        *more,
    ]


def test_options_passed_to_kafka_python(pw_file, tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg = load_config(None, sasl(pw_file, f"security.ca_file={ca}"), env={})
    assert client_options(cfg.security, env={}) == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-256",
        "sasl_plain_username": "svc",
        "sasl_plain_password": SECRET,
        "ssl_check_hostname": True,
        "ssl_cafile": str(ca),
    }
    assert client_options(load_config(None, [], env={})["security"]) == {}


def test_password_from_the_environment(pw_file):
    sets = [s for s in sasl(pw_file) if "password_file" not in s] + ["security.password_env=PW"]
    cfg = load_config(None, sets, env={"PW": SECRET})
    assert client_options(cfg.security, env={"PW": SECRET})["sasl_plain_password"] == SECRET
    # the generic PANAGG_SECURITY_PASSWORD is not a way in: secrets come by name only (refused,
    # so that it is not mistaken for one), unless security.password_env names it
    with pytest.raises(ConfigError, match="PANAGG_SECURITY_PASSWORD is not read") as err:
        load_config(None, [], env={"PANAGG_SECURITY_PASSWORD": SECRET})
    assert SECRET not in str(err.value)
    sets = [s for s in sasl(pw_file) if "password_file" not in s] + [
        "security.password_env=PANAGG_SECURITY_PASSWORD"
    ]
    cfg = load_config(None, sets, env={"PANAGG_SECURITY_PASSWORD": SECRET})
    assert cfg.security.password == ""


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["security.protocol=TLS"], "security.protocol must be one of"),
        (["security.protocol=SASL_SSL"], "needs security.sasl_mechanism"),
        (
            ["security.protocol=SASL_SSL", "security.sasl_mechanism=GSSAPI"],
            "needs security.sasl_mechanism",
        ),
        (
            ["security.protocol=SASL_SSL", "security.sasl_mechanism=PLAIN"],
            "needs security.username",
        ),
        (
            ["security.protocol=SASL_SSL", "security.sasl_mechanism=PLAIN", "security.username=u"],
            "needs the SASL password",
        ),
        (
            [
                "security.protocol=SASL_SSL",
                "security.sasl_mechanism=PLAIN",
                "security.username=u",
                f"security.password={SECRET}",
            ],
            "security.allow_inline_password",
        ),
        (
            [
                "security.protocol=SASL_SSL",
                "security.sasl_mechanism=PLAIN",
                "security.username=u",
                "security.password_env=NOT_SET_ANYWHERE",
            ],
            "NOT_SET_ANYWHERE, which is not set",
        ),
        (
            [
                "security.protocol=SASL_SSL",
                "security.sasl_mechanism=PLAIN",
                "security.username=u",
                "security.password_file=/nonexistent/pw",
            ],
            "cannot be read",
        ),
        (["security.username=u"], "does not use SASL"),
        (["security.ca_file=/etc/hostname"], "does not use TLS"),
        (["security.protocol=SSL", "security.ca_file=/nonexistent/ca.pem"], "not a readable file"),
    ],
)
def test_bad_security_config_is_one_line_without_the_secret(sets, fragment):
    with pytest.raises(ConfigError, match=fragment) as err:
        load_config(None, sets, env={})
    assert SECRET not in str(err.value)
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            *sum([["--set", s] for s in sets], []),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PANAGG_TESTING"},
    )
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and fragment.split(",")[0] in res.stderr
    assert SECRET not in res.stderr + res.stdout


def test_wrong_type_error_does_not_echo_the_password(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(f'[security]\npassword = ["{SECRET}"]\n')
    with pytest.raises(ConfigError, match="security.password must be a string") as err:
        load_config(str(toml), env={})
    assert SECRET not in str(err.value)


def test_inline_password_only_when_insisted_and_never_saved(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'[security]\nprotocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\n'
        f'username = "u"\npassword = "{SECRET}"\nallow_inline_password = true\n'
    )
    cfg = load_config(str(toml), env={})
    assert client_options(cfg.security)["sasl_plain_password"] == SECRET
    assert SECRET not in repr(redacted(cfg))
    assert cfg.security.password == SECRET  # redacted() copies; the live config keeps it
