"""Debian's nginx running ``ops/nginx.conf`` as shipped, as the current user, in front of a
test stack: what tests/clients/test_nginx.py drives.

``Edge`` makes a test CA and a certificate for 127.0.0.1 (``cryptography``), writes the
shipped config with only the substitutions a test machine needs (each one a line marked
``# (test: ...)`` in ops/nginx.conf, found exactly once, or the test fails: an edit of the
config cannot silently leave one out), and runs ``nginx -p TMP -c TMP/nginx.conf -e ...``
in the foreground. ``reload`` is ``nginx -s reload``, done when new workers answer.
``EdgeStack``: the API processes behind it, each on a port of its own (killed and started
again there); ``serve_folder``: a page of another origin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import getpass
import http.server
import ipaddress
import os
import re
import ssl
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.clients.conftest import ClientStack
from tests.e2e.conftest import free_port
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "ops" / "nginx.conf"
NGINX = Path(os.environ.get("LASTEVENT_NGINX", "/usr/sbin/nginx"))
TEMP_PATHS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
CA_USAGE = dict.fromkeys(
    [
        "digital_signature",
        "content_commitment",
        "key_encipherment",
        "data_encipherment",
        "key_agreement",
        "encipher_only",
        "decipher_only",
    ],
    False,
) | {"key_cert_sign": True, "crl_sign": True}


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1, 127.0.0.2 and localhost: the
    paths of the CA's certificate, the server's certificate and its key."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "lastevent test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(**CA_USAGE), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost")] + [
        x509.IPAddress(ipaddress.ip_address(a)) for a in ("127.0.0.1", "127.0.0.2")
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = (folder / "ca.pem", folder / "fullchain.pem", folder / "privkey.pem")
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem) + ca.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def substitute(text: str, old: str, new: str) -> str:
    """``old`` replaced by ``new``; ``old`` must be in ``text`` exactly once."""
    count = text.count(old)
    assert count == 1, f"ops/nginx.conf has {count} of {old!r}: the test's substitutions"
    return text.replace(old, new)


def render_config(
    shipped: str,
    *,
    folder: Path,
    https_port: int,
    http_port: int,
    upstreams: Sequence[str],
    read_timeout_s: int,
) -> str:
    """The shipped config, with what must differ on a test machine."""
    c = substitute(shipped, "listen 443 ssl http2;", f"listen 127.0.0.1:{https_port} ssl http2;")
    c = substitute(c, "listen 80;", f"listen 127.0.0.1:{http_port};")
    lines = "\n".join(f"        server {u};" for u in upstreams)
    c = substitute(c, "        server api:8000;", lines)
    c = substitute(c, "/etc/nginx/tls/fullchain.pem", str(folder / "fullchain.pem"))
    c = substitute(c, "/etc/nginx/tls/privkey.pem", str(folder / "privkey.pem"))
    c = substitute(c, "/var/log/nginx/access.log", str(folder / "access.log"))
    c = substitute(c, "/var/log/nginx/error.log", str(folder / "error.log"))
    c = substitute(c, "proxy_read_timeout 1h;", f"proxy_read_timeout {read_timeout_s}s;")
    temp = "".join(f"    {name}_temp_path {folder / name};\n" for name in TEMP_PATHS)
    return substitute(c, "\nhttp {\n", "\nhttp {\n" + temp)


def shipped_read_timeout_s(shipped: str) -> float:
    """The shipped proxy_read_timeout, in seconds (nginx's units: s, m, h)."""
    found = re.findall(r"^\s*proxy_read_timeout\s+(\d+)([smh]?)\s*;", shipped, re.M)
    assert len(found) == 1, found
    value, unit = found[0]
    return int(value) * {"": 1, "s": 1, "m": 60, "h": 3600}[unit]


class Edge:
    """nginx from the shipped config, on 127.0.0.1, in front of ``upstreams``."""

    def __init__(self, folder: Path, upstreams: Sequence[str], *, read_timeout_s: int) -> None:
        if not NGINX.exists():
            raise AssertionError(f"{NGINX} is missing: `make test-clients` installs Debian's nginx")
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca, _, _ = make_certificates(folder)
        self.https_port, self.http_port = free_port(), free_port()
        self.config = folder / "nginx.conf"
        self.config.write_text(
            render_config(
                SHIPPED.read_text(),
                folder=folder,
                https_port=self.https_port,
                http_port=self.http_port,
                upstreams=upstreams,
                read_timeout_s=read_timeout_s,
            )
        )
        self.access_log = folder / "access.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def tls(self) -> ssl.SSLContext:
        """A client's TLS context that trusts the test CA (and nothing else)."""
        return ssl.create_default_context(cafile=str(self.ca))

    def _command(self, *more: str) -> list[str]:
        # as root nginx would hand its workers to `nobody`: keep them this user's
        user = f" user {getpass.getuser()};" if os.geteuid() == 0 else ""
        return [
            str(NGINX),
            "-p",
            f"{self.folder}/",
            "-c",
            str(self.config),
            "-e",
            str(self.folder / "startup-error.log"),
            "-g",
            f"pid {self.folder / 'nginx.pid'}; daemon off;{user}",
            *more,
        ]

    def start(self) -> Edge:
        check = subprocess.run(self._command("-t"), capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        with open(self.folder / "nginx.out", "ab") as out:
            self.proc = subprocess.Popen(self._command(), stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: len(self.workers()) > 0, what="nginx's workers", timeout=30)
        return self

    def workers(self) -> set[int]:
        """The pids of the master's worker processes now."""
        assert self.proc is not None
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return {int(p) for p in children.read_text().split()}
        except OSError:
            return set()

    def reload(self) -> None:
        """``nginx -s reload``; returns once workers of the new configuration run."""
        before = self.workers()
        done = subprocess.run(self._command("-s", "reload"), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        wait_until(lambda: self.workers() - before, what="nginx's new workers", timeout=30)

    def log(self) -> str:
        return self.access_log.read_text(errors="replace") if self.access_log.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclasses.dataclass
class EdgeStack(ClientStack):
    """Two API processes on ports of their own (one is killed and started again on its
    port) and one worker with one slot."""

    ports: list[int] = dataclasses.field(default_factory=list)

    def start_api_at(self, port: int) -> str:
        proc = self._spawn("api", f"api-{port}-{len(self.procs)}", port=port)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert proc.poll() is None, self.tail(f"api-{port}-{len(self.procs) - 1}")
            try:
                return httpx.get(url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, what=f"the API on {port}", timeout=60)
        self.api_procs[url] = proc
        if url not in self.api_urls:
            self.api_urls.append(url)
        return url

    def kill_api(self, url: str) -> None:
        self.api_procs[url].kill()
        self.api_procs[url].wait()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serve_folder(folder: Path, port: int) -> Iterator[None]:
    """``folder``'s files over HTTP on 127.0.0.1:``port`` (a page of another origin)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
