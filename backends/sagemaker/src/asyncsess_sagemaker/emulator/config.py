"""Emulator settings: timings of the state machines, fault injection, strictness."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["AccountKey", "EmulatorConfig", "FaultConfig"]


class FaultConfig(BaseModel):
    """Seeded fault injection, applied per HTTP request before (or, for lost responses, after) handling.

    - ``throttle_rate``: answer ``ThrottlingException`` without doing anything.
    - ``internal_error_rate``: answer ``InternalServerException`` without doing anything.
    - ``lost_response_rate``: do the work, then answer ``InternalServerException`` (a reply lost on the way
      back; the client must retry with the same client token and get the same operation).
    - ``truncated_response_rate``: do the work, then answer 200 with the reply cut short (a reply broken on the way
      back: the client cannot read it and must retry with the same client token).
    - ``latency_s``: added to every request.
    - ``operations``: only these operation names are affected (``None``: every wire operation).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # latency_s=Infinity hung every request

    throttle_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    internal_error_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    lost_response_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    truncated_response_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    latency_s: float = Field(default=0.0, ge=0.0)
    operations: list[str] | None = None
    seed: int = 0


class AccountKey(BaseModel):
    """One access key of :attr:`EmulatorConfig.accounts`: its secret and the account it signs for."""

    model_config = ConfigDict(extra="forbid")

    account_id: str = Field(pattern=r"^\d{12}$")
    secret_access_key: str = Field(min_length=1)


class EmulatorConfig(BaseModel):
    """Timings in seconds. The real service publishes none of them; the defaults keep tests quick."""

    model_config = ConfigDict(extra="forbid")

    region: str = "us-west-2"
    account_id: str = Field(default="111122223333", pattern=r"^\d{12}$")
    accounts: dict[str, AccountKey] = Field(
        default_factory=dict,
        description="access key id -> its account and secret: only these keys are taken, their signatures verified, and "
        "each account sees only its own sessions, model packages and groups (empty: any access key is account_id's, and "
        "the SigV4 header is checked for form only)",
    )
    startup_s: float = Field(default=0.05, ge=0.0, description="Created -> Scheduled -> Running")
    stop_s: float = Field(default=0.02, ge=0.0, description="Stopping -> Stopped, Deleting -> gone")
    gap_timeout_s: float = Field(default=30.0, gt=0.0, description="Blocked on a missing sequence number -> Failed")
    idle_timeout_s: float | None = Field(default=None, gt=0.0, description="no request for this long -> Expired")
    result_wait_s: float = Field(
        default=0.0, ge=0.0, description="Get*OperationResult waits this long for completion (0: answer at once, as the service does)"
    )
    check_responses: bool = Field(default=False, description="validate every response against the service model's output shape")
    publish_vocab_size: bool = Field(
        default=True,
        description="each hub document publishes the model's VocabSize (False: none, so only the service refuses a token id past "
        "the vocabulary, after the op took its number)",
    )
    sample_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="generate at most this many tokens per sequence, below the request's maxTokens (None: maxTokens, as the "
        "service does; the wire's minimum of 512 is slow on a CPU engine in tests)",
    )
    faults: FaultConfig = Field(default_factory=FaultConfig)
