"""The service against a secured real broker: SASL (PLAIN, SCRAM) over TLS and mutual TLS, with a
test CA and certificates made at test time by the openssl CLI (deploy/kafka/kafka.sh,
KAFKA_SECURE=1). A wrong password, a wrong CA, a wrong host name and a missing client
certificate each give one line naming the fix: no traceback, no secret.

One broker per module. ``PANAGG_KAFKA_SECURE_STATE=DIR`` reuses a broker already started with
``KAFKA_SECURE=1 deploy/kafka/kafka.sh start DIR`` (quicker when iterating).
"""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import pytest
from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[2]
KAFKA_SH = ROOT / "deploy" / "kafka" / "kafka.sh"
D = 1000


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """{plaintext, sasl_ssl, ssl: bootstrap addresses; state: the broker's state dir}"""
    reuse = os.environ.get("PANAGG_KAFKA_SECURE_STATE")
    missing = [t for t in ("java", "mvn", "openssl") if shutil.which(t) is None]
    if missing and not reuse:
        pytest.fail(f"secured-broker tests need {', '.join(missing)} on PATH")
    state = Path(reuse) if reuse else tmp_path_factory.mktemp("kafka-secure")
    res = subprocess.run(
        [str(KAFKA_SH), "start", str(state)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, KAFKA_SECURE="1"),
    )
    if res.returncode != 0:
        pytest.fail(f"could not start the secured broker: {res.stderr.strip()[-2000:]}")
    lines = dict(line.split("=", 1) for line in res.stdout.split() if "=" in line)
    info = {
        "plaintext": lines["bootstrap"],
        "sasl_ssl": lines["sasl_ssl"],
        "ssl": lines["ssl"],
        "state": state,
        "password": (state / "secrets" / "password").read_text().strip(),
    }
    try:
        yield info
    finally:
        if not reuse:
            subprocess.run([str(KAFKA_SH), "stop", str(state)], capture_output=True, timeout=120)


def tls(secure, name):
    return str(secure["state"] / "tls" / name)


def sasl_client(secure, mechanism="SCRAM-SHA-512"):
    return dict(
        bootstrap_servers=secure["sasl_ssl"],
        security_protocol="SASL_SSL",
        sasl_mechanism=mechanism,
        sasl_plain_username="panagg",
        sasl_plain_password=secure["password"],
        ssl_cafile=tls(secure, "ca.pem"),
    )


def make_topic(secure, partitions=2):
    name = f"s-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(**sasl_client(secure))  # topics made over SASL_SSL too
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    admin.close()
    return name


def produce(secure, topic, values):
    producer = KafkaProducer(linger_ms=20, acks="all", **sasl_client(secure))
    for v in values:
        producer.send(topic, value=v)
    producer.flush()
    producer.close()


def run(secure, tmp_path, topic, *sets, bootstrap=None, timeout=120, env=None):
    args = [
        sys.executable,
        "-m",
        "aggregator.service.cli",
        "run",
        "--bootstrap",
        bootstrap or secure["sasl_ssl"],
        "--topic",
        topic,
        "--state-dir",
        str(tmp_path / "state"),
        "--release-dir",
        str(tmp_path / "releases"),
        "--metrics-port",
        "-1",
        "--exit-when-idle",
        "3",
        "--set",
        f"state.domain_size={D}",
        "--set",
        f"source.group=g-{topic}",
        "--set",
        "release.on_exhausted=false",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "source.connect_timeout_s=3",
    ]
    for s in sets:
        args += [s] if s.startswith("--") else ["--set", s]
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PANAGG_TESTING="1", **(env or {})),
    )


def sasl_sets(secure, tmp_path, mechanism="SCRAM-SHA-512", password=None):
    pw_file = tmp_path / "kafka.password"
    pw_file.write_text((password or secure["password"]) + "\n")
    pw_file.chmod(0o600)
    return [
        "security.protocol=SASL_SSL",
        f"security.sasl_mechanism={mechanism}",
        "security.username=panagg",
        f"security.password_file={pw_file}",
        f"security.ca_file={tls(secure, 'ca.pem')}",
    ]


def assert_one_clear_line(res, *needles, secrets=()):
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    assert "Traceback" not in out
    errors = [line for line in res.stderr.splitlines() if line.startswith("panagg: error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    for secret in secrets:
        assert secret not in out
    return errors[0]


def released_n(tmp_path):
    return json.loads((tmp_path / "releases" / "release-0.json").read_text())["n"]


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_service_consumes_over_sasl_ssl(secure, tmp_path, mechanism):
    topic = make_topic(secure, partitions=1)
    dlq = f"{topic}-dlq"
    values = [msgpack.packb({"item": i % D}) for i in range(3000)]
    values[17] = b"\xc1 not msgpack"  # one reject: the dead-letter producer is secured too
    produce(secure, topic, values)
    res = run(
        secure,
        tmp_path,
        topic,
        *sasl_sets(secure, tmp_path, mechanism),
        "window.size=2999",
        f"source.dead_letter_topic={dlq}",
        "--verbose",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert released_n(tmp_path) == 2999
    assert secure["password"] not in res.stderr + res.stdout
    saved = (tmp_path / "state" / "config.json").read_text()
    assert secure["password"] not in saved
    consumer = KafkaConsumer(
        dlq, auto_offset_reset="earliest", group_id=f"check-{dlq}", **sasl_client(secure)
    )
    got = set()
    for _ in range(20):
        got |= {r.key for recs in consumer.poll(timeout_ms=500).values() for r in recs}
        if got:
            break
    consumer.close()
    assert got == {f"{topic}:0@17".encode()}


def test_password_from_an_environment_variable(secure, tmp_path):
    topic = make_topic(secure, partitions=1)
    produce(secure, topic, [msgpack.packb({"item": i % D}) for i in range(500)])
    sets = [
        s
        for s in sasl_sets(secure, tmp_path, "SCRAM-SHA-256")
        if not s.startswith("security.password_file")
    ]
    res = run(
        secure,
        tmp_path,
        topic,
        *sets,
        "security.password_env=KAFKA_PW",
        "window.size=500",
        env={"KAFKA_PW": secure["password"]},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert released_n(tmp_path) == 500
    assert secure["password"] not in res.stderr + (tmp_path / "state" / "config.json").read_text()


def test_wrong_password_is_one_line_naming_the_fix(secure, tmp_path):
    topic = make_topic(secure, partitions=1)
    wrong = "WRONG-pw-" + uuid.uuid4().hex
    res = run(
        secure,
        tmp_path,
        topic,
        *sasl_sets(secure, tmp_path, password=wrong),
        "source.connect_timeout_s=5",
    )
    line = assert_one_clear_line(
        res, "security.password_file", "security.username", secrets=(wrong, secure["password"])
    )
    # the broker's answer when the client reads it, else the close that follows it
    assert "SASL authentication failed" in line or "SASL credentials are wrong" in line


def test_wrong_ca_is_one_line_naming_the_fix(secure, tmp_path):
    topic = make_topic(secure, partitions=1)
    sets = [s for s in sasl_sets(secure, tmp_path) if not s.startswith("security.ca_file")]
    res = run(secure, tmp_path, topic, *sets, f"security.ca_file={tls(secure, 'other-ca.pem')}")
    assert_one_clear_line(
        res, "security.ca_file", "not signed by a CA", secrets=(secure["password"],)
    )


def test_host_name_is_checked_by_default(secure, tmp_path):
    """The broker's certificate names 127.0.0.1 only; connecting as localhost must fail."""
    topic = make_topic(secure, partitions=1)
    port = secure["sasl_ssl"].rsplit(":", 1)[1]
    res = run(secure, tmp_path, topic, *sasl_sets(secure, tmp_path), bootstrap=f"localhost:{port}")
    assert_one_clear_line(
        res, "security.check_hostname", "not valid for the name", secrets=(secure["password"],)
    )


def test_mutual_tls(secure, tmp_path):
    topic = make_topic(secure, partitions=1)
    produce(secure, topic, [msgpack.packb({"item": i % D}) for i in range(400)])
    base = ["security.protocol=SSL", f"security.ca_file={tls(secure, 'ca.pem')}"]
    res = run(secure, tmp_path / "nocert", topic, *base, bootstrap=secure["ssl"])
    assert_one_clear_line(res, "client certificate", "security.cert_file")
    res = run(
        secure,
        tmp_path / "cert",
        topic,
        *base,
        f"security.cert_file={tls(secure, 'client.pem')}",
        f"security.key_file={tls(secure, 'client.key')}",
        "window.size=400",
        bootstrap=secure["ssl"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert released_n(tmp_path / "cert") == 400


def test_plaintext_client_on_a_tls_listener(secure, tmp_path):
    topic = make_topic(secure, partitions=1)
    res = run(secure, tmp_path, topic)
    assert_one_clear_line(res, "security.protocol")


def test_inline_password_refused_unless_insisted_then_warned(secure, tmp_path):
    topic = make_topic(secure, partitions=1)
    produce(secure, topic, [msgpack.packb({"item": 1})] * 50)
    sets = [s for s in sasl_sets(secure, tmp_path) if not s.startswith("security.password_file")]
    cfg = tmp_path / "panagg.toml"
    cfg.write_text(f'[security]\npassword = "{secure["password"]}"\n')
    args_cfg = ["--config", str(cfg)]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            *args_cfg,
            "--bootstrap",
            secure["sasl_ssl"],
            "--topic",
            topic,
            "--state-dir",
            str(tmp_path / "state"),
            "--metrics-port",
            "-1",
            *[x for s in sets for x in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert_one_clear_line(
        res,
        "security.password_file",
        "security.allow_inline_password",
        secrets=(secure["password"],),
    )
    cfg.write_text(f'[security]\npassword = "{secure["password"]}"\nallow_inline_password = true\n')
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            *args_cfg,
            "--bootstrap",
            secure["sasl_ssl"],
            "--topic",
            topic,
            "--state-dir",
            str(tmp_path / "state"),
            "--metrics-port",
            "-1",
            "--release-dir",
            str(tmp_path / "releases"),
            "--exit-when-idle",
            "3",
            "--set",
            f"state.domain_size={D}",
            "--set",
            "window.size=50",
            "--set",
            "release.error_bar_reps=0",
            *[x for s in sets for x in ("--set", s)],
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "password is inline" in res.stderr
    assert secure["password"] not in res.stderr + (tmp_path / "state" / "config.json").read_text()
    assert released_n(tmp_path) == 50
