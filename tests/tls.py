"""TLS for the test servers: certificates of a CA of their own (which no system trusts), and
the first ``redis-server`` found that was built with TLS."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import trustme

from celery_lock.testing import RedisServer, find_redis_server


class TlsFiles(NamedTuple):
    """A CA's certificate, and a certificate it issued for 127.0.0.1 with its key."""

    ca_file: str
    cert_file: str
    key_file: str

    @classmethod
    def issue(cls, directory: Path) -> TlsFiles:
        ca = trustme.CA()
        cert = ca.issue_cert("127.0.0.1")
        files = cls(*(str(directory / name) for name in ("ca.crt", "server.crt", "server.key")))
        ca.cert_pem.write_to_path(files.ca_file)
        cert.cert_chain_pems[0].write_to_path(files.cert_file)
        cert.private_key_pem.write_to_path(files.key_file)
        return files

    def server_args(self, tls_port: int) -> list[str]:
        """``redis-server`` options that make it listen with TLS on ``tls_port`` too, showing
        this certificate, and take clients that show none."""
        return [
            "--tls-port", str(tls_port), "--tls-auth-clients", "no",
            "--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file,
            "--tls-ca-cert-file", self.ca_file,
        ]  # fmt: skip


def start_with_tls(server_for: Callable[[str], RedisServer]) -> RedisServer:
    """``server_for(executable)``, started, from the first ``redis-server`` that starts with
    the TLS options it is given; a skip where none does (a failure under ``CI=true``)."""
    candidates = list(dict.fromkeys([find_redis_server(), "/usr/bin/redis-server"]))
    for executable in filter(os.path.exists, candidates):
        server = server_for(executable)
        try:
            server.start()
        except RuntimeError:  # built without TLS: it refuses --tls-port
            continue
        return server
    if os.environ.get("CI") == "true":
        pytest.fail(f"no redis-server built with TLS among {candidates} and CI=true")
    pytest.skip(f"no redis-server built with TLS among {candidates}")
