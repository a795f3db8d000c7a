"""Protocol-level readiness probes: "listening" must mean "usable", not "port open".

Each probe completes a real exchange with the broker (an AMQP 0-9-1 handshake with login
and vhost, a Kafka ApiVersions request, an SQS ``ListQueues`` call, a PostgreSQL login
with SCRAM and a ``SELECT version()``) using the standard
library only, so the test bed scripts and the container launcher of the conformance plugin
can run them before any client library is installed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.client
import secrets
import socket
import struct

HOST = "127.0.0.1"

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _amqp_method(channel: int, class_id: int, method_id: int, args: bytes) -> bytes:
    payload = struct.pack(">HH", class_id, method_id) + args
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def _amqp_read_method(sock: socket.socket) -> tuple[int, int, bytes]:
    ftype, _channel, size = struct.unpack(">BHI", _recv_exact(sock, 7))
    payload = _recv_exact(sock, size + 1)[:-1]
    if ftype != 1:
        raise ConnectionError(f"expected a method frame, got frame type {ftype}")
    class_id, method_id = struct.unpack(">HH", payload[:4])
    return class_id, method_id, payload[4:]


def _shortstr(value: str) -> bytes:
    raw = value.encode()
    return struct.pack(">B", len(raw)) + raw


def amqp_handshake(
    host: str,
    port: int,
    user: str = "guest",
    password: str = "guest",
    vhost: str = "/",
    timeout: float = 3.0,
) -> dict[str, object]:
    """Open and politely close an AMQP 0-9-1 connection (PLAIN auth); raise on any failure.

    Start, Start-Ok, Tune, Tune-Ok, Open, Open-Ok, Close, Close-Ok: proves the server is
    booted, accepts the credentials and serves the vhost, which a port check cannot.
    Returns the server properties of Connection.Start (``product``, ``version`` ...).
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(b"AMQP\x00\x00\x09\x01")
        cls, mth, args = _amqp_read_method(sock)
        if (cls, mth) != (10, 10) or args[:2] != b"\x00\x09":
            raise ConnectionError(f"not an AMQP 0-9-1 Connection.Start: {(cls, mth)}")
        server_properties = _amqp_table(args, 2)[0]
        response = b"\x00" + user.encode() + b"\x00" + password.encode()
        # client-properties: {capabilities: {authentication_failure_close: true}} makes a
        # refused login answer with Connection.Close at once instead of a silent delay
        inner = _shortstr("authentication_failure_close") + b"t\x01"
        caps = _shortstr("capabilities") + b"F" + struct.pack(">I", len(inner)) + inner
        start_ok = (
            struct.pack(">I", len(caps))
            + caps
            + _shortstr("PLAIN")
            + struct.pack(">I", len(response))
            + response
            + _shortstr("en_US")
        )
        sock.sendall(_amqp_method(0, 10, 11, start_ok))
        cls, mth, args = _amqp_read_method(sock)
        if (cls, mth) != (10, 30):
            raise ConnectionError(f"login refused for {user!r} (got method {(cls, mth)})")
        channel_max, frame_max, _heartbeat = struct.unpack(">HIH", args[:8])
        tune_ok = struct.pack(">HIH", channel_max, frame_max, 0)
        sock.sendall(_amqp_method(0, 10, 31, tune_ok))
        sock.sendall(_amqp_method(0, 10, 40, _shortstr(vhost) + _shortstr("") + b"\x00"))
        cls, mth, _ = _amqp_read_method(sock)
        if (cls, mth) != (10, 41):
            raise ConnectionError(f"vhost {vhost!r} refused (got method {(cls, mth)})")
        close = struct.pack(">H", 200) + _shortstr("probe done") + struct.pack(">HH", 0, 0)
        sock.sendall(_amqp_method(0, 10, 50, close))
        with contextlib.suppress(OSError):
            _amqp_read_method(sock)  # Close-Ok; a missing one still proves readiness
    return server_properties


_AMQP_FIXED = {"t": ">B", "b": ">b", "B": ">B", "s": ">h", "u": ">H", "I": ">i", "i": ">I",
               "l": ">q", "L": ">Q", "f": ">f", "d": ">d", "T": ">Q"}


def _amqp_table(buf: bytes, pos: int) -> tuple[dict[str, object], int]:
    """Decode an AMQP field table at *pos*; return it and the position after it."""
    (size,) = struct.unpack_from(">I", buf, pos)
    pos += 4
    end = pos + size
    table: dict[str, object] = {}
    while pos < end:
        klen = buf[pos]
        key = buf[pos + 1 : pos + 1 + klen].decode(errors="replace")
        pos += 1 + klen
        kind = chr(buf[pos])
        pos += 1
        if kind == "S" or kind == "x":
            (n,) = struct.unpack_from(">I", buf, pos)
            table[key] = buf[pos + 4 : pos + 4 + n].decode(errors="replace")
            pos += 4 + n
        elif kind == "F":
            table[key], pos = _amqp_table(buf, pos)
        elif kind in _AMQP_FIXED:
            fmt = _AMQP_FIXED[kind]
            (table[key],) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
        elif kind == "V":
            table[key] = None
        else:  # arrays and decimals: not in a server's properties; stop decoding here
            break
    return table, end


def amqp_ready(host: str = HOST, port: int = 5672, timeout: float = 3.0, **kw: str) -> bool:
    """True when an AMQP server at host:port completes a full handshake with guest/guest."""
    try:
        amqp_handshake(host, port, timeout=timeout, **kw)
    except (OSError, ValueError, struct.error):
        return False
    return True


def _kafka_request(host: str, port: int, api_key: int, version: int, body: bytes,
                   timeout: float) -> bytes:
    """One Kafka request with a v1 request header; the response after its correlation id."""
    correlation_id = secrets.randbits(31)
    client_id = b"mqabstract-probe"
    head = struct.pack(">hhih", api_key, version, correlation_id, len(client_id)) + client_id
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        sock.sendall(struct.pack(">i", len(head) + len(body)) + head + body)
        (size,) = struct.unpack(">i", _recv_exact(sock, 4))
        if not 4 <= size <= 1 << 24:
            raise ConnectionError(f"implausible Kafka response size {size}")
        resp = _recv_exact(sock, size)
    if struct.unpack(">i", resp[:4])[0] != correlation_id:
        raise ConnectionError("Kafka response with a foreign correlation id")
    return resp[4:]


def kafka_api_versions(host: str, port: int, timeout: float = 3.0) -> dict[int, tuple[int, int]]:
    """Send a Kafka ApiVersions v0 request; return ``{api_key: (min, max)}`` or raise."""
    resp = _kafka_request(host, port, 18, 0, b"", timeout)
    error, count = struct.unpack(">hi", resp[:6])
    if error != 0 or count <= 0:
        raise ConnectionError(f"bad ApiVersions response (error {error}, count {count})")
    versions = {}
    for i in range(count):
        key, lo, hi = struct.unpack(">hhh", resp[6 + 6 * i : 12 + 6 * i])
        versions[key] = (lo, hi)
    return versions


def kafka_brokers(host: str, port: int, timeout: float = 3.0) -> list[int]:
    """Node ids of the brokers a Kafka node reports as registered (Metadata v1, no topics)."""
    resp = _kafka_request(host, port, 3, 1, struct.pack(">i", 0), timeout)
    (count,) = struct.unpack_from(">i", resp, 0)
    pos, nodes = 4, []
    for _ in range(count):
        node_id, hlen = struct.unpack_from(">ih", resp, pos)
        pos += 6 + hlen + 4  # host, port
        (rlen,) = struct.unpack_from(">h", resp, pos)
        pos += 2 + max(rlen, 0)  # nullable rack
        nodes.append(node_id)
    return sorted(nodes)


def kafka_ready(host: str = HOST, port: int = 9092, timeout: float = 3.0) -> bool:
    """True when host:port answers ApiVersions and supports Produce (0) and Fetch (1)."""
    try:
        versions = kafka_api_versions(host, port, timeout)
    except (OSError, struct.error):
        return False
    return 0 in versions and 1 in versions


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, url-safe base64 without padding (22 chars),
    the format of ``kafka-storage random-uuid`` without starting a JVM for it. Like Kafka's
    own, never one starting with "-": the storage tool's argument parser takes it for an
    option (a CI run failed on "-dZL5…")."""
    while True:
        cid = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def sqs_ready(host: str = HOST, port: int = 5055, timeout: float = 3.0) -> bool:
    """True when host:port answers an SQS ``ListQueues`` call (moto, LocalStack, ...).

    The Authorization header only names the service so moto routes to SQS; emulators
    do not check the signature.
    """
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/",
            body="Action=ListQueues&Version=2012-11-05",
            headers={
                "Content-Type": "application/x-www-form-urlencoded",
                "Authorization": "AWS4-HMAC-SHA256 Credential=probe/20240101/us-east-1/sqs/"
                "aws4_request, SignedHeaders=host, Signature=0",
            },
        )
        resp = conn.getresponse()
        return resp.status == 200 and b"ListQueues" in resp.read(65536)
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


#: The test bed's PostgreSQL login (scripts/brokerctl.py creates it; a test password only).
PG_USER, PG_PASSWORD, PG_DATABASE = "mq", "mqsecret", "mqtest"


def _pg_message(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack(">i", len(payload) + 4) + payload


def _pg_read(sock: socket.socket) -> tuple[bytes, bytes]:
    kind = _recv_exact(sock, 1)
    (size,) = struct.unpack(">i", _recv_exact(sock, 4))
    if not 4 <= size <= 1 << 24:
        raise ConnectionError(f"implausible PostgreSQL message size {size}")
    return kind, _recv_exact(sock, size - 4)


def _pg_error(payload: bytes) -> str:
    fields = {f[:1]: f[1:].decode(errors="replace") for f in payload.split(b"\0") if f}
    return fields.get(b"M", "error")


def _pg_scram(sock: socket.socket, password: str) -> None:
    """SCRAM-SHA-256 (RFC 5802/7677) as PostgreSQL speaks it: the user name comes from
    the startup message, no channel binding."""
    nonce = base64.b64encode(secrets.token_bytes(18)).decode()
    first_bare = f"n=,r={nonce}"
    first = ("n,," + first_bare).encode()
    sock.sendall(_pg_message(b"p", b"SCRAM-SHA-256\0" + struct.pack(">i", len(first)) + first))
    kind, payload = _pg_read(sock)
    if kind != b"R" or struct.unpack(">i", payload[:4])[0] != 11:
        raise ConnectionError(_pg_error(payload) if kind == b"E" else "SCRAM: no server-first")
    server_first = payload[4:].decode()
    attrs = dict(item.split("=", 1) for item in server_first.split(","))
    if not attrs["r"].startswith(nonce):
        raise ConnectionError("SCRAM: the server changed our nonce")
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(attrs["s"]),
                                 int(attrs["i"]))
    client_key = hmac.digest(salted, b"Client Key", "sha256")
    final_bare = f"c=biws,r={attrs['r']}"
    auth = f"{first_bare},{server_first},{final_bare}".encode()
    signature = hmac.digest(hashlib.sha256(client_key).digest(), auth, "sha256")
    proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
    final = f"{final_bare},p={base64.b64encode(proof).decode()}".encode()
    sock.sendall(_pg_message(b"p", final))
    kind, payload = _pg_read(sock)
    if kind != b"R" or struct.unpack(">i", payload[:4])[0] != 12:
        raise ConnectionError(_pg_error(payload) if kind == b"E" else "SCRAM: no server-final")
    server_key = hmac.digest(salted, b"Server Key", "sha256")
    expected = base64.b64encode(hmac.digest(server_key, auth, "sha256")).decode()
    if payload[4:].decode() != f"v={expected}":
        raise ConnectionError("SCRAM: the server's signature does not match")


def pg_query(host: str, port: int, sql: str, user: str = PG_USER,
             password: str = PG_PASSWORD, database: str = PG_DATABASE,
             timeout: float = 3.0) -> list[str | None]:
    """Log in to PostgreSQL (trust, cleartext, MD5 or SCRAM-SHA-256), run one simple query
    and return the first column of its rows as text; raise on any failure."""
    params = f"user\0{user}\0database\0{database}\0\0".encode()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        body = struct.pack(">i", 196608) + params  # protocol 3.0
        sock.sendall(struct.pack(">i", len(body) + 4) + body)
        rows: list[str | None] = []
        query_sent = False
        while True:
            kind, payload = _pg_read(sock)
            if kind == b"E":
                raise ConnectionError(_pg_error(payload))
            if kind == b"R":
                code = struct.unpack(">i", payload[:4])[0]
                if code == 3:
                    sock.sendall(_pg_message(b"p", password.encode() + b"\0"))
                elif code == 5:
                    inner = hashlib.md5((password + user).encode()).hexdigest().encode()
                    digest = hashlib.md5(inner + payload[4:8]).hexdigest()
                    sock.sendall(_pg_message(b"p", f"md5{digest}".encode() + b"\0"))
                elif code == 10:
                    if b"SCRAM-SHA-256\0" not in payload[4:]:
                        raise ConnectionError("no SASL mechanism this probe speaks")
                    _pg_scram(sock, password)
                elif code != 0:
                    raise ConnectionError(f"authentication method {code} not supported")
            elif kind == b"D":
                (length,) = struct.unpack(">i", payload[2:6])
                rows.append(None if length < 0 else payload[6:6 + length].decode())
            elif kind == b"Z":
                if query_sent:
                    with contextlib.suppress(OSError):
                        sock.sendall(_pg_message(b"X", b""))
                    return rows
                sock.sendall(_pg_message(b"Q", sql.encode() + b"\0"))
                query_sent = True


def postgresql_ready(host: str = HOST, port: int = 55432, timeout: float = 3.0) -> bool:
    """True when host:port logs the test bed's user in and answers ``SELECT 1``."""
    try:
        return pg_query(host, port, "SELECT 1", timeout=timeout) == ["1"]
    except (OSError, ValueError, KeyError, struct.error):
        return False


PROBES = {"rabbitmq": amqp_ready, "kafka": kafka_ready, "sqs": sqs_ready, "tansu": kafka_ready,
          "postgresql": postgresql_ready}


def ready(kind: str, port: int, host: str = HOST, timeout: float = 3.0) -> bool:
    """Protocol-level readiness probe for a broker of *kind* at host:port."""
    return PROBES[kind](host, port, timeout=timeout)
