"""The job's credential (``Options.job_secret``, ``DDL_JOB_SECRET``): what a process proves it holds to
join a running job, where the store alone is not enough.

Semantics. The secret is given to every process of the job by its launcher: ``ddlrun`` draws one
(``draw``) for its ranks, as Horovod's runner draws its secret key; under torchrun or ``env://`` the
user sets the same value for every process. It never enters the store, a message or an error. What
crosses the store is a proof: ``proof(secret, job, member)``, an HMAC-SHA256 over the job's own
nonce (drawn once per job, kept in the store) and the joiner's member id. A proof serves one
member id of one job: copied from the store, it admits no other process under another id, and it
is worth nothing in another job that happens to share the secret. ``holds`` checks one in constant
time. Who may join, and what the store's readers can still do: docs/security.md.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

_LABEL = b"ddl-join/1"
NONCE_HEX = 32     # the job nonce: 16 random bytes, hex
PROOF_HEX = 64     # an HMAC-SHA256, hex


def draw() -> str:
    """A fresh secret for a job (64 hex digits: 256 random bits)."""
    return secrets.token_hex(32)


def job_nonce() -> str:
    """A fresh nonce naming one job (the members publish it in the store)."""
    return secrets.token_hex(NONCE_HEX // 2)


def proof(secret: str, job: str, member: int) -> str:
    """The proof, for the job whose nonce is ``job``, that member ``member`` holds ``secret``."""
    message = b"|".join((_LABEL, job.encode(), str(int(member)).encode()))
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def holds(secret: str, job: str, member: int, claimed) -> bool:
    """Whether ``claimed`` is member ``member``'s proof of ``secret`` for this job (constant time)."""
    if not secret or not isinstance(claimed, str) or len(claimed) != PROOF_HEX:
        return False
    return hmac.compare_digest(proof(secret, job, member), claimed)
