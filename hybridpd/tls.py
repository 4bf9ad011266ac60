"""`--tls-cert --tls-key [--tls-ca]`, shared by `serve` and `proxy`: one frozen config that builds every TLS context.

- HTTP (node server, proxy -> node) and the gRPC side channel (node server, decoder -> prefill node) use TLS when a
  certificate and key are given.
- With `--tls-ca` the authentication is mutual: servers require a client certificate signed by that CA, clients
  verify the server's certificate (and its address, which must be in the certificate's subjectAltName) against it
  and present their own. A peer without a valid certificate is refused.
- Without `--tls-ca` clients still verify the server, against the certificates in `--tls-cert` (a certificate
  shared by the cluster, or a chain that ends in its CA), so an active man in the middle cannot read the cluster
  token; servers do not ask clients for a certificate. `--tls-insecure` turns the HTTP clients' verification off
  (encryption only), with a loud warning at start-up.
The files are read once at start-up; a missing or unreadable file is a clear error (the CLI exits 2).
"""

from __future__ import annotations

import argparse
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger(__name__)


def add_tls_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                        help="certificate (chain) this process presents, as server and as client")
    parser.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="its private key")
    parser.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                        help="CA that signs every cluster certificate: turns on mutual authentication")
    parser.add_argument("--tls-insecure", action="store_true",
                        help="HTTPS clients do not verify the server (encryption only; anyone in the middle can read "
                             "the cluster token): for a test bench, never for a cluster")


@dataclass(frozen=True)
class TLSConfig:
    cert: bytes
    key: bytes = b""
    ca: bytes | None = None
    cert_path: Path | None = None
    key_path: Path | None = None
    ca_path: Path | None = None
    insecure: bool = False     # HTTP clients skip verifying the server (--tls-insecure)

    def __repr__(self) -> str:  # never shows the key
        return f"TLSConfig(cert={self.cert_path}, ca={self.ca_path})"

    @property
    def mutual(self) -> bool:
        return self.ca is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TLSConfig | None:
        """None when TLS is off; raises ValueError (a message for the user) on a bad combination or file."""
        cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
        insecure = bool(args.tls_insecure)
        if cert is None and key is None:
            if ca is not None:
                raise ValueError("--tls-ca needs --tls-cert and --tls-key (this process's own certificate)")
            if insecure:
                raise ValueError("--tls-insecure needs --tls-cert and --tls-key (it relaxes TLS, it does not start it)")
            return None
        if insecure and ca is not None:
            raise ValueError("--tls-insecure and --tls-ca contradict each other: mutual TLS always verifies")
        if cert is None or key is None:
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        config = cls(cert=_read(cert, "--tls-cert"), key=_read(key, "--tls-key"),
                     ca=_read(ca, "--tls-ca") if ca is not None else None, cert_path=cert, key_path=key, ca_path=ca,
                     insecure=insecure)
        config.server_context()  # the files must parse and the key must match the certificate
        config.client_context()
        if insecure:
            log.warning("--tls-insecure: HTTPS clients do NOT verify the server; anyone in the middle can read the "
                        "cluster token and every prompt")
        return config

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(self.cert_path), str(self.key_path))
            if self.ca_path is not None:
                context.load_verify_locations(cafile=str(self.ca_path))
                context.verify_mode = ssl.CERT_REQUIRED
        except ssl.SSLError as exc:
            raise ValueError(f"TLS: cannot use {self.cert_path} / {self.key_path} / {self.ca_path}: {exc}") from exc
        return context

    def client_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(str(self.cert_path), str(self.key_path))
            if self.ca_path is not None:
                context.load_verify_locations(cafile=str(self.ca_path))
            elif self.insecure:  # encryption without authentication (--tls-insecure)
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            else:  # the cluster's own certificate (or the chain in it) is the trust anchor
                context.load_verify_locations(cafile=str(self.cert_path))
                context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        except ssl.SSLError as exc:
            raise ValueError(f"TLS: cannot use {self.cert_path} / {self.key_path} / {self.ca_path}: {exc}") from exc
        return context

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.mutual)

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca if self.ca is not None else self.cert,
                                            private_key=self.key, certificate_chain=self.cert)


def _read(path: Path, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror}") from exc
