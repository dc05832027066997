"""Shared-token auth and TLS for every connection to a shard server (no torch import).

Tokens. The server checks the metadata `authorization: Bearer <token>` on every
RPC (ps/edge/auth.py). A token comes from a file (`--auth-token-file`, first line,
surrounding whitespace stripped) or, without one, from the environment
(HYBRIDPS_AUTH_TOKEN for workers and stats; HYBRIDPS_ADMIN_TOKEN for admin
calls that change state). There is deliberately no flag that takes the token
itself: command lines are visible to every user of the machine (`ps aux`).

TLS. A client uses TLS when it is given `--tls true` or any --tls-* file:
`--tls-ca` (the CA that signed the server's certificate; default: the system
roots), `--tls-cert`/`--tls-key` (its own certificate, for servers that
require client certificates: mutual TLS) and `--tls-server-name` (the name to
check in the server's certificate when the address is an IP or an alias).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

log = logging.getLogger("hybridps.security")

AUTH_TOKEN_ENV = "HYBRIDPS_AUTH_TOKEN"
ADMIN_TOKEN_ENV = "HYBRIDPS_ADMIN_TOKEN"
AUTH_HEADER = "authorization"
BEARER = "Bearer "
MIN_TOKEN_CHARS = 16


class SecurityError(ValueError):
    """A token or certificate file that cannot be used; the message names it."""


def read_token(path: str = "", env_var: str = AUTH_TOKEN_ENV,
               environ: Mapping[str, str] | None = None, *, what: str = "token") -> str:
    """The token from `path`, else from `env_var`; '' when neither is set."""
    environ = os.environ if environ is None else environ
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise SecurityError(f"{what} file {path!r}: {exc.strerror or exc}") from None
        token = text.strip().splitlines()[0].strip() if text.strip() else ""
        if not token:
            raise SecurityError(f"{what} file {path!r} is empty")
        _warn_if_readable_by_others(path, what)
    else:
        token = environ.get(env_var, "").strip()
    if token and len(token) < MIN_TOKEN_CHARS:
        source = f"file {path!r}" if path else env_var
        raise SecurityError(f"{what} from {source} has {len(token)} characters; use at least "
                            f"{MIN_TOKEN_CHARS} (e.g. `python -c 'import secrets; "
                            "print(secrets.token_urlsafe(32))'`)")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise SecurityError(f"{what} must be printable without spaces (it travels as gRPC "
                            "metadata)")
    return token


def ensure_token_file(path: str, env_var: str = AUTH_TOKEN_ENV,
                      environ: Mapping[str, str] | None = None) -> bool:
    """Create the token file `path` (mode 0600, never replacing one) holding `env_var`'s
    token when set, else a random one (secrets.token_urlsafe(32): 256 bits). Returns True
    when it created the file. Lets a deployment (docker-compose.yml) have a token that
    nobody had to invent: the server creates it in a volume the workers also mount."""
    environ = os.environ if environ is None else environ
    token = environ.get(env_var, "").strip() or secrets.token_urlsafe(32)
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise SecurityError(f"auth token file {path!r}: cannot create it: "
                            f"{exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())
    log.info("event=token_generated path=%s mode=600", path)
    return True


def _warn_if_readable_by_others(path: str, what: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("event=token_file_permissions what=%s path=%s mode=%o "
                    "hint=\"chmod 600\"", what.replace(" ", "_"), path, mode & 0o777)


def read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SecurityError(f"{what} {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise SecurityError(f"{what} {path!r} is not PEM (no '-----BEGIN' line)")
    return data


def token_matches(given: str, expected: str) -> bool:
    """Constant-time comparison (hmac.compare_digest) of two tokens."""
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The token of `authorization: Bearer <token>` in call metadata ('' when absent)."""
    for key, value in metadata or ():
        if key.lower() == AUTH_HEADER:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if text.startswith(BEARER):
                return text[len(BEARER):].strip()
    return ""


# -- client side -----------------------------------------------------------------------

@dataclass(frozen=True)
class ClientSecurity:
    """What a client (worker, admin CLI) needs to reach a secured server."""

    token: str = ""
    tls: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str = ""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Per-call metadata: the bearer token, or nothing."""
        return ((AUTH_HEADER, BEARER + self.token),) if self.token else ()

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, int | str]]:
        if self.tls and self.server_name:
            return [("grpc.ssl_target_name_override", self.server_name)]
        return []

    def describe(self) -> str:
        parts = ["tls" if self.tls else "plaintext"]
        if self.cert:
            parts.append("client-cert")
        if self.token:
            parts.append("token")
        return "+".join(parts)


def client_security(*, token_file: str = "", token_env: str = AUTH_TOKEN_ENV, tls: bool = False,
                    ca_file: str = "", cert_file: str = "", key_file: str = "",
                    server_name: str = "", environ: Mapping[str, str] | None = None
                    ) -> ClientSecurity:
    """Load the client's token and TLS material (SecurityError naming the bad file)."""
    if bool(cert_file) != bool(key_file):
        raise SecurityError("--tls-cert and --tls-key go together (mutual TLS needs both)")
    use_tls = tls or bool(ca_file or cert_file or server_name)
    return ClientSecurity(
        token=read_token(token_file, token_env, environ),
        tls=use_tls,
        ca=read_pem(ca_file, "--tls-ca") if ca_file else None,
        cert=read_pem(cert_file, "--tls-cert") if cert_file else None,
        key=read_pem(key_file, "--tls-key") if key_file else None,
        server_name=server_name,
    )


def open_channel(address: str, options: Sequence[tuple[str, int | str]],
                 security: ClientSecurity | None = None) -> grpc.Channel:
    """A blocking-API channel, TLS when `security` says so."""
    security = security or ClientSecurity()
    opts = [*options, *security.channel_options()]
    creds = security.channel_credentials()
    if creds is None:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, creds, options=opts)


def open_aio_channel(address: str, options: Sequence[tuple[str, int | str]],
                     security: ClientSecurity | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel, TLS when `security` says so."""
    security = security or ClientSecurity()
    opts = [*options, *security.channel_options()]
    creds = security.channel_credentials()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, creds, options=opts)


# -- server side -----------------------------------------------------------------------

def server_credentials(cert_file: str, key_file: str,
                       client_ca_file: str = "") -> grpc.ServerCredentials | None:
    """TLS credentials (None without a certificate); a client CA makes it mutual TLS."""
    if not (cert_file or key_file):
        if client_ca_file:
            raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (cert_file and key_file):
        raise SecurityError("--tls-cert and --tls-key go together")
    pair = (read_pem(key_file, "--tls-key"), read_pem(cert_file, "--tls-cert"))
    client_ca = read_pem(client_ca_file, "--tls-client-ca") if client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)
