"""One TLS context per process for every HTTP client (the engine clients' pools, the launcher's
health checks): httpx's default (certifi's CAs; SSL_CERT_FILE and SSL_CERT_DIR honoured), which
every client otherwise builds anew, reading the CA bundle each time (20 ms a client; one engine's
17 clients took a third of a second of CPU at each start of the driver)."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    """httpx's default context, made on first use and shared (clients only read it)."""
    return httpx.create_ssl_context()
