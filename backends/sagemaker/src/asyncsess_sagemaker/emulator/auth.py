"""Who is calling: the request's SigV4 ``Authorization`` header, checked as AWS checks it, names the caller's account.

With ``EmulatorConfig.accounts`` empty, any access key is the emulator's ``account_id`` and the header is checked for
form (scope, date, region, service) only: the secret is unknown. With accounts configured, only their access keys are
taken, each for its own account, and the signature is verified with its secret, so two accounts' calls are apart.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from datetime import datetime, timedelta, timezone
from urllib.parse import quote

from botocore.utils import normalize_url_path
from starlette.requests import Request

from .config import EmulatorConfig
from .errors import AwsError

__all__ = ["caller_account"]

SIGNING_NAME = "sagemaker"  # both services sign with it (the runtime model's signingName)
ALGORITHM = "AWS4-HMAC-SHA256"
MAX_SKEW = timedelta(minutes=15)
_PART = re.compile(r"\s*(Credential|SignedHeaders|Signature)=([^,\s]*)\s*")


def _incomplete(message: str) -> AwsError:
    return AwsError("IncompleteSignatureException", message, status=400)


def _invalid(message: str) -> AwsError:
    return AwsError("InvalidSignatureException", message, status=403)


def _parse(header: str) -> dict[str, str]:
    algorithm, _, rest = header.strip().partition(" ")
    if algorithm != ALGORITHM:
        raise _incomplete(f"Authorization header requires the {ALGORITHM} algorithm, not {algorithm[:32]!r}")
    parts: dict[str, str] = {}
    for piece in rest.split(","):
        m = _PART.fullmatch(piece)
        if m is None or m.group(1) in parts:
            raise _incomplete(f"Authorization header is malformed near {piece.strip()[:64]!r}")
        parts[m.group(1)] = m.group(2)
    missing = [k for k in ("Credential", "SignedHeaders", "Signature") if not parts.get(k)]
    if missing:
        raise _incomplete(f"Authorization header requires '{missing[0]}' parameter")
    return parts


def _canonical_request(request: Request, signed: list[str], body: bytes) -> str:
    """The canonical request as botocore's ``SigV4Auth.canonical_request`` builds it on the client."""
    raw_path = request.scope.get("raw_path") or request.url.path.encode()
    path = quote(normalize_url_path(raw_path.decode("latin-1")), safe="/~")
    query = request.scope.get("query_string", b"").decode("latin-1")
    pairs = sorted(p.partition("=")[::2] for p in query.split("&")) if query else []
    headers = []
    for name in signed:
        values = request.headers.getlist(name)
        headers.append(f"{name}:{','.join(' '.join(v.split()) for v in values)}")
    payload = request.headers.get("x-amz-content-sha256") or hashlib.sha256(body).hexdigest()
    return "\n".join(
        [request.method.upper(), path, "&".join(f"{k}={v}" for k, v in pairs), "\n".join(headers) + "\n", ";".join(signed), payload]
    )


def _signature(secret: str, stamp: str, region: str, canonical: str) -> str:
    def sign(key: bytes, msg: str) -> bytes:
        return hmac.new(key, msg.encode(), hashlib.sha256).digest()

    scope = f"{stamp[:8]}/{region}/{SIGNING_NAME}/aws4_request"
    to_sign = "\n".join([ALGORITHM, stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = sign(sign(sign(sign(f"AWS4{secret}".encode(), stamp[:8]), region), SIGNING_NAME), "aws4_request")
    return hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()


def caller_account(request: Request, body: bytes, config: EmulatorConfig, now: datetime | None = None) -> str:
    """The account of the access key that signed ``request`` (with ``body``), or an AwsError as AWS answers a
    missing (``MissingAuthenticationTokenException``), malformed (``IncompleteSignatureException``), unknown
    (``UnrecognizedClientException``) or wrong (``InvalidSignatureException``) signature: a 4xx before any work."""
    header = request.headers.get("authorization")
    if not header:
        raise AwsError("MissingAuthenticationTokenException", "Missing Authentication Token", status=403)
    parts = _parse(header)
    scope = parts["Credential"].split("/")
    if len(scope) != 5 or not scope[0]:
        raise _incomplete(f"Credential {parts['Credential'][:128]!r} is not ACCESS_KEY/DATE/REGION/SERVICE/aws4_request")
    access_key, date, region, service, terminator = scope
    stamp = request.headers.get("x-amz-date", "")
    try:
        when = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        raise _incomplete("Authorization requires an X-Amz-Date header of the form YYYYMMDDTHHMMSSZ") from None
    signed = parts["SignedHeaders"].split(";")
    if "host" not in signed or "x-amz-date" not in signed or signed != sorted(set(signed)) or any(s != s.lower() for s in signed):
        raise _incomplete("SignedHeaders must list host and x-amz-date, in lowercase, sorted, each once")
    if date != stamp[:8] or region != config.region or service != SIGNING_NAME or terminator != "aws4_request":
        raise _invalid(
            f"Credential should be scoped to {stamp[:8]}/{config.region}/{SIGNING_NAME}/aws4_request, not {'/'.join(scope[1:])[:128]!r}"
        )
    now = now or datetime.now(timezone.utc)
    if abs(now - when) > MAX_SKEW:
        raise _invalid(f"Signature expired: {stamp} is not within 15 minutes of the server's time {now:%Y%m%dT%H%M%SZ}")
    sent = request.headers.get("x-amz-content-sha256")
    if sent is not None and sent != hashlib.sha256(body).hexdigest():
        raise _invalid("The X-Amz-Content-SHA256 header does not match the body")
    if not config.accounts:
        return config.account_id
    key = config.accounts.get(access_key)
    if key is None:
        raise AwsError("UnrecognizedClientException", "The security token included in the request is invalid.", status=403)
    expected = _signature(key.secret_access_key, stamp, region, _canonical_request(request, signed, body))
    if not hmac.compare_digest(expected, parts["Signature"]):
        raise _invalid(
            "The request signature we calculated does not match the signature you provided. "
            "Check your AWS Secret Access Key and signing method."
        )
    return key.account_id
