"""How a lanes process authenticates to NATS: the options, their command-line flags and
LANES_NATS_* variables. Apart from shared/bus.py so the CLI builds its parser without
importing the NATS client (offline commands start faster)."""

from __future__ import annotations

import argparse
import os
import ssl
from dataclasses import dataclass


@dataclass(frozen=True)
class NatsAuth:
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: str | None = None
    nkey_seed: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connect_options(self) -> dict:
        opts: dict = {}
        if self.user:
            opts["user"], opts["password"] = self.user, self.password or ""
        if self.token:
            opts["token"] = self.token
        if self.creds:
            opts["user_credentials"] = self.creds
        if self.nkey_seed:
            opts["nkeys_seed"] = self.nkey_seed
        if self.tls_ca or self.tls_cert:
            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            opts["tls"] = ctx
        return opts


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--user", default=env("LANES_NATS_USER"))
    p.add_argument("--password", default=env("LANES_NATS_PASSWORD"))
    p.add_argument("--token", default=env("LANES_NATS_TOKEN"))
    p.add_argument("--creds", default=env("LANES_NATS_CREDS"), help="NATS .creds file (JWT + nkey)")
    p.add_argument("--nkey", default=env("LANES_NATS_NKEY"), help="nkey seed file")
    p.add_argument("--tls-ca", default=env("LANES_NATS_TLS_CA"))
    p.add_argument("--tls-cert", default=env("LANES_NATS_TLS_CERT"))
    p.add_argument("--tls-key", default=env("LANES_NATS_TLS_KEY"))


def auth_from_args(args: argparse.Namespace) -> NatsAuth:
    return NatsAuth(
        user=args.user,
        password=args.password,
        token=args.token,
        creds=args.creds,
        nkey_seed=args.nkey,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
    )
