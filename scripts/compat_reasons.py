"""Why a row of docs/compatibility.md is not "same": ``"<anchor>:<member>" -> (status, reason)``.

``<anchor>`` is ``tinker``, ``sagemaker`` or ``*`` (both); ``<member>`` is the row's member text; a key ending
in ``*`` covers every member that starts with it (so one entry covers a method and its ``_async`` twin). Status
``refused``: the name exists and raises ``UnsupportedError`` naming itself and the fix (its rows are never "same").
"""

from __future__ import annotations

NO_SERVICE = "asyncsess backends have no multi-user service account: no projects, billing, audit log or publishing"
DESCRIPTION = (
    "position 0 is Tinker's `name`; a first argument that is not a valid checkpoint name (1-128 of A-Za-z0-9._-) is taken "
    "as SageMaker's description, a valid name stays a name (on sagemaker:// it is sent as the description). "
    "`description=` is always the description"
)

UNEMBED = "SageMaker's default None, which means True (Tinker's default): the same behaviour; False still freezes the unembedding"

REASONS: dict[str, tuple[str, str]] = {
    # ---------------------------------------------------------------- Tinker ServiceClient / clients
    "tinker:ServiceClient.copy_weights": ("missing", "copy-on-write into another project: " + NO_SERVICE),
    "tinker:ServiceClient.create_custom_loss": (
        "missing",
        "server-side custom losses (alpha) are not offered; `forward_backward_custom` lowers any loss to cross_entropy",
    ),
    "tinker:ServiceClient.get_console_url": ("missing", "there is no web console"),
    "tinker:TrainingClient.get_console_url": ("missing", "there is no web console"),
    "tinker:RestClient.get_telemetry": ("missing", "asyncsess sends no telemetry"),
    "tinker:SamplingClient.create": ("missing", "internal constructor of Tinker's holder; use `ServiceClient.create_sampling_client`"),
    "tinker:ServiceClient.create_lora_training_client(train_unembed)*": ("differs", UNEMBED),
    "tinker:ServiceClient.create_lora_training_client_async(train_unembed)": ("differs", UNEMBED),
    "tinker:TrainingClient.save_weights_and_get_sampling_client(retry_config)*": (
        "differs",
        "position 1 is SageMaker's `merge_weights` (a bool); pass `retry_config=` by keyword (retries follow the ServiceClient's policy)",
    ),
    "tinker:TrainingClient.save_weights_for_sampler(ttl_seconds)*": (
        "differs",
        "position 1 is SageMaker's `merge_weights` (a bool; an int there is refused with a hint); pass `ttl_seconds=` by keyword",
    ),
    "tinker:TrainingClient.save_weights_for_sampler_async(ttl_seconds)": (
        "differs",
        "position 1 is SageMaker's `merge_weights` (a bool; an int there is refused with a hint); pass `ttl_seconds=` by keyword",
    ),
    "tinker:TrainingClient.save_weights_and_get_sampling_client_async(retry_config)": (
        "differs",
        "position 1 is SageMaker's `merge_weights` (a bool); pass `retry_config=` by keyword",
    ),
    # ---------------------------------------------------------------- Tinker types
    "tinker:SampleResponse.prompt_alt_tokens": ("missing", "`prompt_alt_tokens_k` is not offered (refused with UnsupportedError)"),
    # ---------------------------------------------------------------- Tinker RestClient (session-less admin)
    "tinker:RestClient.assign_session_project*": ("missing", NO_SERVICE),
    "tinker:RestClient.copy_weights*": ("missing", NO_SERVICE),
    "tinker:RestClient.export_session_trace*": ("missing", "no Perfetto traces are recorded"),
    "tinker:RestClient.get_audit_log*": ("missing", NO_SERVICE),
    "tinker:RestClient.get_billing_usage*": ("missing", NO_SERVICE + "; per-op token usage is on every result's `.usage`"),
    "tinker:RestClient.get_current_checkpoint_storage_usage*": ("missing", NO_SERVICE + "; `Checkpoint.size_bytes` gives sizes"),
    "tinker:RestClient.get_external_weights_urls*": ("missing", "no signed-URL store: local:// checkpoints are directories on disk"),
    "tinker:RestClient.get_sampler*": ("missing", "samplers are listed by `ServiceClient.list_sessions()`"),
    "tinker:RestClient.get_server_capabilities": ("missing", "use `ServiceClient.get_server_capabilities()`"),
    "tinker:RestClient.get_session*": ("missing", "use `ServiceClient.describe_session()`"),
    "tinker:RestClient.list_sessions*": ("missing", "use `ServiceClient.list_sessions()`"),
    "tinker:RestClient.search_sessions": ("missing", "use `ServiceClient.list_sessions(name_contains=...)`"),
    "tinker:RestClient.get_training_run(access_scope)": ("missing", NO_SERVICE + ": every run is the caller's own"),
    "tinker:RestClient.list_training_runs(access_scope)": ("missing", NO_SERVICE + ": every run is the caller's own"),
    "tinker:RestClient.list_training_runs(project_id)": ("missing", NO_SERVICE),
    "tinker:RestClient.get_training_run_by_tinker_path*": ("missing", "a checkpoint path names its run: use `get_training_run(run_id)`"),
    "tinker:RestClient.get_weights_info_by_tinker_path": ("missing", "use `TrainingClient.get_info()` of a client made from the path"),
    "tinker:RestClient.publish_checkpoint_from_tinker_path*": ("refused", NO_SERVICE + "; raises UnsupportedError naming it"),
    "tinker:RestClient.unpublish_checkpoint_from_tinker_path*": ("refused", NO_SERVICE + "; raises UnsupportedError naming it"),
    "tinker:RestClient.set_checkpoint_ttl_from_tinker_path*": (
        "refused",
        "TTLs are recorded at save time (`ttl_seconds=`), not changed later; raises UnsupportedError naming it",
    ),
    "tinker:RestClient.publish_checkpoint_from_tinker_path_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.unpublish_checkpoint_from_tinker_path_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.set_checkpoint_ttl_from_tinker_path_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.whoami": ("missing", NO_SERVICE),
    "tinker:RestClient.delete_checkpoint_async": (
        "missing",
        "Tinker 0.38 deprecates the RestClient `_async` twins; its methods return futures",
    ),
    "tinker:RestClient.delete_checkpoint_from_tinker_path_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.get_training_run_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.list_checkpoints_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.list_training_runs_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    "tinker:RestClient.list_user_checkpoints_async": ("missing", "deprecated in Tinker 0.38 (the methods return futures)"),
    # ---------------------------------------------------------------- SageMaker
    "sagemaker:ServiceClient.create_lora_training_client(alpha)": (
        "differs",
        "default None lets the backend choose: sagemaker:// sends 2 x rank (64 at the default rank 32, SageMaker's default), "
        "mock:// and local:// use 32",
    ),
    "sagemaker:ServiceClient.create_lora_training_client(train_mlp)": (
        "differs",
        "Tinker's default True; SageMaker's None (service default: train it) is accepted and means True",
    ),
    "sagemaker:ServiceClient.create_lora_training_client(train_attn)": (
        "differs",
        "Tinker's default True; SageMaker's None (service default: train it) is accepted and means True",
    ),
    "sagemaker:TrainingClient.save_state(description)*": ("differs", DESCRIPTION),
    "sagemaker:TrainingClient.save_state_async(description)": ("differs", DESCRIPTION),
    "sagemaker:TrainingClient.save_weights_for_sampler(description)*": ("differs", DESCRIPTION),
    "sagemaker:TrainingClient.save_weights_for_sampler_async(description)": ("differs", DESCRIPTION),
    "sagemaker:TrainingClient.save_weights_and_get_sampling_client(description)*": ("differs", DESCRIPTION),
    "sagemaker:TrainingClient.save_weights_and_get_sampling_client_async(description)": ("differs", DESCRIPTION),
    "sagemaker:SamplingClient.sample(topk_prompt_logprobs)*": ("differs", "Tinker's default 0; SageMaker's None is accepted and means 0"),
    "sagemaker:SamplingClient.sample_async(topk_prompt_logprobs)": (
        "differs",
        "Tinker's default 0; SageMaker's None is accepted and means 0",
    ),
    "sagemaker:Datum.prompt": ("differs", "accepted on input (`Datum(prompt=...)` becomes `model_input`); not kept as a second field"),
    "sagemaker:ModelInput.prompt": (
        "differs",
        "accepted on input (`ModelInput(prompt=[...])` becomes one text chunk); not kept as a field",
    ),
}
