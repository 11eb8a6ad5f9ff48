"""The vLLM sampler's GPU-facing choices, checked without vLLM: through a stand-in for its engine
interface (``VllmSampler``'s methods, ``AsyncLLM``'s start), as the engine and the backend use them.

- An LM-head LoRA on a model whose vLLM class cannot load one is refused (``vllm_unembed=refuse``)
  or sampled with torch (``vllm_unembed=torch``) while other adapters still go to vLLM.
- The engine arguments vLLM starts with: max model length (capped), memory share, adapter cache.
- Adapters are staged in bf16, in /dev/shm when it has room, else beside the checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import asyncsess  # noqa: E402
from asyncsess.backends import parse_url  # noqa: E402
from asyncsess.errors import InvalidInputError  # noqa: E402
from asyncsess.types import SampledSequence, SampleResponse, SamplingParams, Usage  # noqa: E402

from .helpers import DEVICE_KW, sft_datum  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.anyio]

TEXT = "what is 2 plus 3? the answer is 5."


class FakeVllm:
    """Stands in for :class:`VllmSampler` in the engine: records what it is asked to load and sample."""

    instances: list[FakeVllm] = []

    def __init__(self, model_path, *, dtype, max_context, eos_ids, options, device=None, fallback_staging=None):
        from asyncsess_local.vllm_sampler import unembed_lora_supported

        self.options = options
        self.max_model_len = min(max_context, options.max_model_len)
        self.unembed_lora = unembed_lora_supported(model_path)
        self.loaded: dict[str, Path] = {}
        self.submitted: list[str] = []
        self.staging = Path(fallback_staging) / ".fake-staging"
        FakeVllm.instances.append(self)

    def has(self, adapter):
        return adapter in self.loaded

    def add_adapter(self, adapter, lineage, *, peft_dir=None, export=None, nbytes=0):
        if peft_dir is None:
            peft_dir = self.staging / adapter
            export(peft_dir)
        self.loaded[adapter] = peft_dir
        return f"{lineage}-v{len(self.loaded)}"

    def remove_adapter(self, adapter):
        self.loaded.pop(adapter, None)

    def submit(self, job):
        from asyncsess_local.completion import Completion

        self.submitted.append(job.adapter)
        done = Completion()
        seq = SampledSequence(stop_reason="length", tokens=[7] * job.max_tokens, logprobs=[-1.0] * job.max_tokens)
        done.set_result(SampleResponse(sequences=[seq] * job.num_samples, usage=Usage()))
        return done

    def close(self):
        pass


@pytest.fixture
def qwen2_tiny(tiny_dir: Path, tmp_path_factory) -> str:
    """The tiny model relabelled as a Qwen2 (whose vLLM class declares no embedding modules)."""
    import shutil

    d = tmp_path_factory.mktemp("qwen2-label") / "m"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.fixture
def fake_vllm(monkeypatch):
    from asyncsess_local import engine, sessions

    FakeVllm.instances = []
    monkeypatch.setattr(sessions, "VllmSampler", FakeVllm)
    monkeypatch.setattr(engine, "choose_sampler", lambda choice, device: "vllm")
    return FakeVllm.instances


def test_which_models_vllm_gives_an_lm_head_lora(qwen2_tiny, tiny_dir):
    from asyncsess_local.vllm_sampler import unembed_lora_supported

    assert unembed_lora_supported(str(tiny_dir)) is True  # LlamaForCausalLM lists lm_head
    assert unembed_lora_supported(qwen2_tiny) is False
    assert unembed_lora_supported("/nonexistent") is False


async def test_unembed_refused_where_vllm_cannot_load_it(qwen2_tiny, tmp_path, fake_vllm):
    url = f"local://?model={qwen2_tiny}&dir={tmp_path}&vllm_unembed=refuse"
    async with asyncsess.ServiceClient(url, **DEVICE_KW) as svc:
        with pytest.raises(InvalidInputError) as info:
            await svc.create_lora_training_client(qwen2_tiny, rank=4, seed=0)  # train_unembed=True by default
        assert info.value.field == "train_unembed" and "train_unembed=False" in (info.value.fix or "")
        tc = await svc.create_lora_training_client(qwen2_tiny, rank=4, seed=0, train_unembed=False)
        sc = await tc.save_weights_and_get_sampling_client()
        await sc.sample([1, 2, 3], 1, SamplingParams(max_tokens=3, temperature=0.0))
        (vllm,) = fake_vllm
        assert len(vllm.loaded) == 1 and len(vllm.submitted) == 1  # the session without an LM-head LoRA samples on vLLM


async def test_unembed_sampled_with_torch_beside_vllm_adapters(qwen2_tiny, tmp_path, fake_vllm):
    url = f"local://?model={qwen2_tiny}&dir={tmp_path}"  # vllm_unembed=torch is the default
    async with asyncsess.ServiceClient(url, **DEVICE_KW) as svc:
        (vllm,) = fake_vllm
        tok = (await svc.create_lora_training_client(qwen2_tiny, rank=4, seed=0, train_unembed=False)).get_tokenizer()
        prompt = tok.encode("what is 2 plus")
        greedy = SamplingParams(max_tokens=4, temperature=0.0, stop=[])

        head = await svc.create_lora_training_client(qwen2_tiny, rank=4, seed=0)  # with an lm_head LoRA
        await head.forward_backward([sft_datum(tok.encode(TEXT))], "cross_entropy")
        await head.optim_step(asyncsess.AdamParams(learning_rate=5e-2))
        sc = await head.save_weights_and_get_sampling_client()
        out = await sc.sample(prompt, 1, greedy)
        assert vllm.loaded == {} and vllm.submitted == []  # never offered to vLLM
        assert out.sequences[0].tokens != [7] * 4  # the torch sampler's tokens, not the stand-in's

        # what the torch sampler gives for those weights, from a named save on a torch-only backend
        path = (await head.save_weights_for_sampler("head")).path
        torch_url = f"local://?model={qwen2_tiny}&dir={tmp_path}&sampler=torch"
        async with asyncsess.ServiceClient(torch_url, **DEVICE_KW) as plain:
            want = await (await plain.create_sampling_client(model_path=path)).sample(prompt, 1, greedy)
        assert out.sequences[0].tokens == want.sequences[0].tokens

        body = await svc.create_lora_training_client(qwen2_tiny, rank=4, seed=0, train_unembed=False)
        sc2 = await body.save_weights_and_get_sampling_client()
        out2 = await sc2.sample(prompt, 1, greedy)
        assert len(vllm.loaded) == 1 and len(vllm.submitted) == 1 and out2.sequences[0].tokens == [7] * 4


async def test_sampling_context_is_vllms_max_model_len(tiny, tmp_path, fake_vllm):
    url = f"local://?model={tiny}&dir={tmp_path}&vllm_max_model_len=64"
    async with asyncsess.ServiceClient(url, **DEVICE_KW) as svc:
        base = await svc.create_sampling_client(base_model=tiny)
        with pytest.raises(InvalidInputError) as info:
            await base.sample([1] * 60, 1, SamplingParams(max_tokens=10))
        assert info.value.field == "sampling_params.max_tokens" and "(64)" in str(info.value)
        await base.sample([1] * 60, 1, SamplingParams(max_tokens=4))


def test_vllm_options_from_the_url_and_their_checks():
    from asyncsess_local.embedded import _vllm_options
    from asyncsess_local.vllm_sampler import VllmOptions

    o = _vllm_options(
        parse_url("local://?vllm_max_model_len=8192&vllm_memory=0.3&vllm_max_loras=8&vllm_max_cpu_loras=32&vllm_unembed=refuse")
    )
    assert (o.max_model_len, o.memory, o.max_loras, o.cpu_loras, o.unembed) == (8192, 0.3, 8, 32, "refuse")
    assert VllmOptions().cpu_loras == 16 and VllmOptions(max_loras=24).cpu_loras == 24
    for field, kw in [
        ("vllm_memory", {"memory": 0.0}),
        ("vllm_memory", {"memory": float("nan")}),
        ("vllm_max_model_len", {"max_model_len": 0}),
        ("vllm_max_cpu_loras", {"max_loras": 8, "max_cpu_loras": 4}),
        ("vllm_unembed", {"unembed": "maybe"}),
        ("vllm_kv_cache_mb", {"kv_cache_mb": 0}),
    ]:
        with pytest.raises(InvalidInputError) as info:
            VllmOptions(**kw)
        assert info.value.field == field


def test_vllm_engine_arguments(monkeypatch, tiny_dir, tmp_path):
    """What AsyncLLM is started with (its start is replaced: no vLLM here), and on which GPU."""
    import os

    from asyncsess_local import vllm_sampler
    from asyncsess_local.vllm_sampler import VllmOptions, VllmSampler

    seen: dict = {}

    async def start(self, args):
        seen.update(args, visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
        return SimpleNamespace(shutdown=lambda: None)

    monkeypatch.setattr(VllmSampler, "_start", start)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    opts = VllmOptions(memory=0.3, max_model_len=4096, max_loras=2, engine_args={"enforce_eager": True})
    s = VllmSampler(
        str(tiny_dir),
        dtype=torch.bfloat16,
        max_context=131072,
        eos_ids=[2],
        options=opts,
        device=torch.device("cuda:1"),
        fallback_staging=tmp_path,
    )
    try:
        assert seen["max_model_len"] == 4096 == s.max_model_len  # capped, not the model's 131072 positions
        assert (seen["gpu_memory_utilization"], seen["max_loras"], seen["max_cpu_loras"]) == (0.3, 2, 16)
        assert seen["dtype"] == "bfloat16" and seen["enforce_eager"] is True
        assert seen["visible"] == "5"  # vLLM's workers start on the trainer's GPU (cuda:1 of 4,5,6)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6"  # and the process's own setting is back
    finally:
        s.close()
    assert vllm_sampler.VllmSampler is VllmSampler


def test_staging_falls_back_to_disk_when_shared_memory_is_small(monkeypatch, tmp_path):
    import shutil

    from asyncsess_local.vllm_sampler import staging_root

    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    free = {"bytes": 64 << 20}  # a container's default /dev/shm
    monkeypatch.setattr(shutil, "disk_usage", lambda p: SimpleNamespace(total=free["bytes"], used=0, free=free["bytes"]))
    assert staging_root(90 << 20, disk, shm=shm) == disk  # a 0.5B rank-64 adapter does not fit
    free["bytes"] = 2 << 30
    assert staging_root(90 << 20, disk, shm=shm) == shm
    assert staging_root(1, disk, shm=tmp_path / "no-such-dir") == disk


async def test_adapters_are_staged_in_bf16(backend_factory, tiny, tmp_path):
    from safetensors.torch import load_file

    from asyncsess.backends import TrainingSessionSpec

    b = backend_factory()
    try:
        await b.open()
        info = await b.create_training_session(TrainingSessionSpec(base_model=tiny, rank=4, seed=0))
        eng = b.engine
        host = eng.slots[tiny].host
        adapter = eng.sessions[info.model_id].adapter
        host.export_peft(adapter, tmp_path / "bf16", dtype=torch.bfloat16)
        staged, trained = load_file(str(tmp_path / "bf16" / "adapter_model.safetensors")), host.state_dict(adapter)
        assert set(staged) == set(trained) and all(t.dtype == torch.bfloat16 for t in staged.values())
        assert all(torch.equal(staged[k], trained[k].to(torch.bfloat16).cpu()) for k in staged)
        assert host.nbytes(adapter, torch.bfloat16) * 2 == host.nbytes(adapter) == sum(t.numel() * 4 for t in trained.values())
    finally:
        await b.aclose()


def test_worker_cli_passes_the_memory_options(monkeypatch, tmp_path):
    pytest.importorskip("fastapi")
    import uvicorn

    from asyncsess_local import server

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(server, "create_app", lambda backend, keys, **options: seen.update(backend=backend, **options))
    argv = ["--dir", str(tmp_path), "--api-key", "k", "--token-budget", "2048", "--checkpoint-layers", "on"]
    argv += ["--vllm-max-model-len", "16384", "--vllm-max-loras", "6", "--vllm-max-cpu-loras", "24", "--vllm-unembed", "refuse"]
    argv += ["--attention", "sdpa", "--max-body-seconds", "7.5", "--session-timeout", "0", "--max-checkpoint-bytes-per-key", "3G"]
    server.main(argv)
    config = seen["backend"]._config
    assert (config.token_budget, config.checkpoint_layers, config.attention) == (2048, "on", "sdpa")
    assert seen["max_body_seconds"] == 7.5 and seen["session_timeout"] == 0.0  # 0: sessions never expire
    assert seen["max_checkpoint_bytes_per_key"] == 3 << 30
    for bad in ("0", "-1", "1.5G", "G", "lots"):
        with pytest.raises(SystemExit):
            server.main([*argv[:4], "--max-checkpoint-bytes-per-key", bad])
    for bad in ("nan", "inf", "0", "-1", "soon"):  # argparse refuses a useless body deadline before anything starts
        with pytest.raises(SystemExit):
            server.main([*argv[:4], "--max-body-seconds", bad])
    for bad in ("nan", "inf", "-1", "soon"):
        with pytest.raises(SystemExit):
            server.main([*argv[:4], "--session-timeout", bad])
    assert (config.vllm.max_model_len, config.vllm.max_loras, config.vllm.cpu_loras, config.vllm.unembed) == (16384, 6, 24, "refuse")
    with pytest.raises(SystemExit):  # argparse refuses an unknown policy before anything starts
        server.main([*argv[:4], "--vllm-unembed", "sometimes"])
