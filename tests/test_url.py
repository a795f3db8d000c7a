"""URL parsing and secret redaction."""

from __future__ import annotations

import logging

import pytest

import mqabstract
from mqabstract.url import BrokerURL, redact


def test_parse_full_url() -> None:
    u = BrokerURL.parse("amqp://user:p%40ss@host1:5672,host2/vh%2Fx?heartbeat=10&exchange=ex")
    assert u.scheme == "amqp" and u.username == "user" and u.password == "p@ss"
    assert u.hosts == (("host1", 5672), ("host2", None))
    assert u.path == "vh/x"
    assert u.param("heartbeat") == "10" and u.param_dict() == {"heartbeat": "10", "exchange": "ex"}


def test_parse_hostless_query_with_url_value() -> None:
    u = BrokerURL.parse("sqs://?region=us-east-1&endpoint_url=http://127.0.0.1:5055")
    assert u.hosts == () and u.param("endpoint_url") == "http://127.0.0.1:5055"


def test_parse_sqlite_paths() -> None:
    assert BrokerURL.parse("sqlite:////abs/file.db").path == "/abs/file.db"
    assert BrokerURL.parse("sqlite:///rel.db").path == "rel.db"


def test_ipv6_and_bad_port() -> None:
    assert BrokerURL.parse("kafka://[::1]:9092").hosts == (("::1", 9092),)
    with pytest.raises(mqabstract.InvalidURL, match="port"):
        BrokerURL.parse("kafka://h:99999")
    with pytest.raises(mqabstract.InvalidURL):
        BrokerURL.parse("no-scheme-here")
    with pytest.raises(mqabstract.InvalidURL):
        BrokerURL.parse("1x://h")


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:s3cr3tPW@localhost:5672/%2F",
        "amqps://u:s3cr3tPW@h/vh?password=s3cr3tPW",
        "kafka://h:9092?sasl_plain_password=s3cr3tPW&sasl_plain_username=me",
        "sqs://?aws_secret_access_key=s3cr3tPW&region=eu-west-1",
        "sqs://?token=s3cr3tPW",
    ],
)
def test_secrets_never_in_str_repr_or_errors(url: str) -> None:
    u = BrokerURL.parse(url)
    assert "s3cr3tPW" not in str(u) and "s3cr3tPW" not in repr(u)
    assert "***" in str(u)
    assert "s3cr3tPW" not in redact(f"failed to connect to {url} (timeout)")
    assert "s3cr3tPW" not in redact(url)


def test_connect_errors_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(mqabstract.InvalidURL) as info:
        mqabstract.connect("nosuch://user:s3cr3tPW@h/")
    assert "s3cr3tPW" not in str(info.value)
    with pytest.raises(mqabstract.InvalidURL) as info2:
        mqabstract.connect("garbage:s3cr3tPW@h")
    assert "s3cr3tPW" not in str(info2.value)
    assert "s3cr3tPW" not in caplog.text


def test_unknown_scheme_lists_known() -> None:
    with pytest.raises(mqabstract.InvalidURL) as info:
        mqabstract.connect("redis://localhost")
    for scheme in ("memory", "sqlite", "amqp", "kafka", "sqs"):
        assert scheme in str(info.value)


def test_broker_repr_redacted() -> None:
    with mqabstract.connect("memory://repr-test") as broker:
        assert "memory://repr-test" in repr(broker)
