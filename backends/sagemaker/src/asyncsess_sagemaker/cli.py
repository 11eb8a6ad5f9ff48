"""``asyncsess sagemaker ...``: the lead's CLI mounts :data:`app` as its ``sagemaker`` sub-command."""

from __future__ import annotations

import typer

__all__ = ["app"]

app = typer.Typer(help="SageMaker training sessions: the local emulator.", no_args_is_help=True)


@app.command()
def emulate(
    backend: str = typer.Option("mock://", help="asyncsess backend URL the emulator executes on (mock://, local://...)"),
    host: str = typer.Option("127.0.0.1", help="interface to bind"),
    port: int = typer.Option(8089, help="TCP port"),
    region: str = typer.Option("us-west-2", help="region named in ARNs"),
    startup_s: float = typer.Option(0.05, help="seconds from Created to Running"),
    result_wait_s: float = typer.Option(0.0, help="Get*OperationResult waits this long for completion (0: like the service)"),
    latency_ms: float = typer.Option(0.0, help="latency added to every request"),
    throttle_rate: float = typer.Option(0.0, help="fraction of requests answered with ThrottlingException"),
    idle_timeout_s: float = typer.Option(None, help="sessions without requests for this long become Expired"),
    sample_max_tokens: int = typer.Option(None, help="generate at most this many tokens per sequence (default: maxTokens, >= 512)"),
    account: list[str] = typer.Option(
        [],
        help="ACCESS_KEY:SECRET:ACCOUNT_ID, repeatable: only these keys are taken, signatures verified, each account on its "
        "own (default: any key, one account)",
    ),
) -> None:
    """Serve the control plane and runtime wire protocols on http://HOST:PORT (use it as boto3's endpoint_url)."""
    from pydantic import ValidationError

    from .emulator import AccountKey, EmulatorConfig, FaultConfig, serve

    try:
        accounts = {}
        for given in account:
            key, _, rest = given.partition(":")
            secret, _, account_id = rest.rpartition(":")
            if not key or key in accounts:
                raise typer.BadParameter(f"{given.split(':')[0]!r}: give each access key once, as ACCESS_KEY:SECRET:ACCOUNT_ID")
            accounts[key] = AccountKey(account_id=account_id, secret_access_key=secret)
        config = EmulatorConfig(
            region=region,
            startup_s=startup_s,
            result_wait_s=result_wait_s,
            idle_timeout_s=idle_timeout_s,
            sample_max_tokens=sample_max_tokens,
            accounts=accounts,
            faults=FaultConfig(latency_s=latency_ms / 1000, throttle_rate=throttle_rate),
        )
    except ValidationError as err:
        e = err.errors()[0]
        raise typer.BadParameter(f"{'.'.join(map(str, e['loc'])) or 'option'}: {e['msg']}") from None
    typer.echo(f"SageMaker emulator on http://{host}:{port} over {backend} (Ctrl-C to stop)")
    serve(backend, host=host, port=port, config=config)
