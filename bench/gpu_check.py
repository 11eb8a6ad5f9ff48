"""One-shot check of the local CUDA worker on a bare GPU machine (no network), ending in one table.

    bash bench/gpu_wheels.sh                  # here, with network: the light dependencies into .whl/ (< 60 MiB)
    python3 bench/gpu_check.py                # there: bootstrap, local suite fp32 + bf16 on CUDA, benchmarks
    python3 bench/gpu_check.py --device cpu --models tiny --suite none     # a smoke run of the code paths on CPU

The target's own Python (3.12) has torch, transformers and peft but lacks some of the project's light
dependencies (pydantic, tenacity, sniffio, ...): ``--bootstrap`` (on by default) installs ``.whl/*.whl`` into
a scratch directory, puts the repository's sources on ``PYTHONPATH`` and registers the backends' entry
points there, then re-runs this script in that environment.

Steps, each reported in the table (a failing step does not stop the others):

1. the local suite (``-m "local and not vllm"``) with ``ASYNCSESS_TEST_DEVICE=cuda``, in fp32 and in bf16;
2. random-weight Qwen2.5-0.5B- and Llama-3-8B-shaped models (built from a config: no hub, no weights on disk);
3. per model, under ``torch.cuda.set_per_process_memory_fraction(0.6)``: ``forward_backward`` + ``optim_step``
   tokens/s, MFU and peak allocated memory at several token budgets; an over-large budget (the engine must
   survive running out of memory and finish the op at a lower one); bit-exact ``save_state`` / load;
   sampler refresh time; torch-sampler tokens/s; the bf16 gap between the sampler's and the trainer's
   log-probs; whether a seeded sample changes with the batch it is decoded in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(tempfile.gettempdir()) / "asyncsess-gpu-site"
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s from the data sheets
SHAPES = {
    # Qwen2.5-0.5B: 24 layers, hidden 896, GQA 14/2, tied embeddings, 151,936 vocab
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    # Llama-3.1-8B: 32 layers, hidden 4096, GQA 32/8, 128,256 vocab, 131k positions
    "llama-8b": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_theta=5e5,
    ),
    # for a CPU smoke run of this script
    "tiny": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
}
RANDOM_MARKER = "asyncsess-random-init.json"
ROWS: list[tuple[str, str, str]] = []  # (check, result, note)


def row(check: str, result: object, note: str = "") -> None:
    ROWS.append((check, str(result), note))
    print(f"[gpu_check] {check}: {result} {note}", flush=True)


# ------------------------------------------------------------------------------------ bootstrap


def bootstrap(wheel_dir: Path) -> dict[str, str]:
    """Install ``wheel_dir/*.whl`` into SITE, register the backends' entry points, return the environment to run in."""
    import tomllib

    wheels = sorted(wheel_dir.glob("*.whl"))
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(SITE)]
        subprocess.run([*cmd, *map(str, wheels)], check=True)
    SITE.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[str]] = {}
    for project in (ROOT / "backends").glob("*/pyproject.toml"):
        eps = tomllib.loads(project.read_text()).get("project", {}).get("entry-points", {})
        for group, items in eps.items():
            groups.setdefault(group, []).extend(f"{k} = {v}" for k, v in items.items())
    info = SITE / "asyncsess_gpu_check-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: asyncsess-gpu-check\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "\n".join(v) + "\n\n" for g, v in groups.items()))
    sources = [ROOT / "src", *sorted((ROOT / "backends").glob("*/src")), ROOT, SITE]
    env = dict(os.environ, ASYNCSESS_GPU_CHECK_READY="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sources), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


# ----------------------------------------------------------------------------------- the suite


def run_suite(device: str, dtype: str, which: str, timeout: float) -> None:
    files = (
        ["tests/local"]
        if which == "full"
        else [
            "tests/local/test_training.py",
            "tests/local/test_checkpoints.py",
            "tests/local/test_sampler.py",
            "tests/local/test_memory.py",
        ]
    )
    env = dict(os.environ, ASYNCSESS_TEST_DEVICE=device, ASYNCSESS_TEST_DTYPE=dtype)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "local and not vllm", *files]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text = out.stdout + out.stderr
        tail = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln or " error" in ln]
        result = tail[-1].strip("= ") if tail else f"exit {out.returncode}"
        failed = [ln.split(" - ")[0] for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        print(text[-6000:], flush=True)
    except subprocess.TimeoutExpired:
        result, failed = f"timed out after {timeout:.0f}s", []
    row(f"local suite on {device} {dtype}", result, f"{time.perf_counter() - t0:.0f}s; " + "; ".join(failed[:4]))


# ------------------------------------------------------------------------------------- models


def write_random_model(shape: str, path: Path) -> Path:
    """A config and a tokenizer only; weights are drawn at load time (see :func:`patch_loader`)."""
    from transformers import AutoConfig

    from asyncsess_local.testing import _train_tokenizer

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    path.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(384)
    tok.save_pretrained(path)
    config = AutoConfig.for_model(
        model_type, **spec, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    config.save_pretrained(path)
    (path / RANDOM_MARKER).write_text(json.dumps({"shape": shape}))
    return path


def patch_loader() -> None:
    """Make ``load_model`` draw random weights on the device for directories written by :func:`write_random_model`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncsess_local import models

    real = models.load_model

    def load(source, device, dtype):
        if not (Path(source.path) / RANDOM_MARKER).exists():
            return real(source, device, dtype)
        config = AutoConfig.from_pretrained(source.path)
        torch.manual_seed(0)
        with torch.device(device):  # drawn where they live: no 16 GB host copy for the 8B model
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.generation_config.eos_token_id = config.eos_token_id
        model.eval()
        model.requires_grad_(False)
        return model

    models.load_model = load  # sessions.py calls models.load_model at load time


def flops_per_token(config, seq: int) -> float:
    """Useful FLOPs per trained token for LoRA: forward + input gradients (2 + 2) x linear params, plus causal attention."""
    h, layers = config.hidden_size, config.num_hidden_layers
    kv = h // config.num_attention_heads * config.num_key_value_heads
    linear = layers * (h * h * 2 + h * kv * 2 + 3 * h * config.intermediate_size) + h * config.vocab_size
    attention = 2 * layers * seq * h  # QK^T and AV over the causal half, forward
    return 4 * linear + 2 * attention


# ---------------------------------------------------------------------------------- benchmarks


async def bench_model(shape: str, args, workdir: Path) -> None:
    from urllib.parse import quote

    import torch

    import asyncsess
    from asyncsess.types import AdamParams, Datum, ModelInput, SamplingParams

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    name = str(write_random_model(shape, workdir / shape))
    url = f"local://?model={quote(name)}&device={args.device}&dtype={args.dtype}&dir={quote(str(workdir / 'ckpt'))}&sampler=torch"
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[shape]["vocab_size"]

    def datum(n: int) -> Datum:
        ids = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
        return Datum(model_input=ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n})

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    async with asyncsess.ServiceClient(url, token_budget=max(args.budgets)) as svc:
        engine = svc.backend.engine
        slot = await engine.call(engine.slot, name)
        config = slot.host.peft.get_base_model().config
        if cuda:
            torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device)
        n_params = sum(p.numel() for p in slot.host.peft.get_base_model().parameters())
        row(f"{shape}: model", f"{n_params / 1e9:.2f}B params", f"{args.dtype}, {slot.checkpointed_layers} layers checkpointed")
        tc = await svc.create_lora_training_client(name, rank=args.rank, seed=0)
        adam = AdamParams(learning_rate=1e-5)
        peak_flops = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name(device)), None)

        # --- forward_backward throughput per token budget
        for budget in args.budgets:
            engine.token_budget = budget
            seq = min(args.seq_len, budget)
            data = [datum(seq) for _ in range(max(1, budget // seq))]
            tokens = sum(d.model_input.length for d in data)
            try:
                await tc.forward_backward(data, "cross_entropy")
                await tc.optim_step(adam)
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    await tc.forward_backward(data, "cross_entropy")
                    await tc.optim_step(adam)
                    sync()
                    times.append(time.perf_counter() - t0)
                dt = statistics.median(times)
                tps = tokens / dt
                mfu = f"{tps * flops_per_token(config, seq) / peak_flops:.1%}" if peak_flops else "n/a"
                peak = f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if cuda else "n/a"
                row(f"{shape}: fb+step budget {budget}", f"{tps:,.0f} tok/s", f"MFU {mfu}, peak {peak}, {len(data)}x{seq} tokens")
            except Exception as err:
                row(f"{shape}: fb+step budget {budget}", f"FAILED {type(err).__name__}", str(err)[:160])
                tc = await svc.create_lora_training_client(name, rank=args.rank, seed=0)

        # --- running out of memory: an over-large budget must end in a finished op at a lower one
        big = args.oom_budget
        engine.token_budget = big
        before = engine.stats["oom"]
        seq = min(args.seq_len * 4, big)
        data = [datum(seq) for _ in range(max(1, big // seq))]
        try:
            await tc.forward_backward(data, "cross_entropy")
            step = await tc.optim_step(adam)
            row(
                f"{shape}: OOM survived",
                "yes" if engine.stats["oom"] > before else "no OOM hit",
                f"{engine.stats['oom'] - before} OOM(s); budget {big} -> {engine.token_budget}; step {step.step}",
            )
        except Exception as err:
            row(f"{shape}: OOM survived", f"FAILED {type(err).__name__}", str(err)[:160])
            tc = await svc.create_lora_training_client(name, rank=args.rank, seed=0)
        engine.token_budget = min(args.budgets)

        # --- bit-exact save and load on the device
        probe = [datum(min(256, args.seq_len)) for _ in range(2)]
        try:
            saved = await tc.save_state("gpu-check")
            want = await tc.forward(probe, "cross_entropy")
            tc2 = await svc.create_training_client_from_state_with_optimizer(saved.path)
            got = await tc2.forward(probe, "cross_entropy")
            a = engine.slots[name].host.state_dict(engine.sessions[tc.model_id].adapter)
            b = engine.slots[name].host.state_dict(engine.sessions[tc2.model_id].adapter)
            same_w = all(torch.equal(a[k], b[k]) for k in a)
            same_lp = all(x["logprobs"].data == y["logprobs"].data for x, y in zip(want.loss_fn_outputs, got.loss_fn_outputs))
            row(f"{shape}: save/load bit-exact", "yes" if same_w and same_lp else "NO", f"weights {same_w}, log-probs {same_lp}")
        except Exception as err:
            row(f"{shape}: save/load bit-exact", f"FAILED {type(err).__name__}", str(err)[:160])

        # --- sampler refresh, torch-sampler throughput, trainer vs sampler log-probs, batch invariance
        try:
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                sc = await tc.save_weights_and_get_sampling_client()
                times.append(time.perf_counter() - t0)
            row(f"{shape}: sampler refresh", f"{statistics.median(times) * 1e3:.0f} ms", "in-memory snapshot, median of 3")
            prompt = torch.randint(0, 384, (args.prompt_len,), generator=gen).tolist()
            params = SamplingParams(max_tokens=args.sample_tokens, temperature=1.0, seed=1, stop=[])
            await sc.sample(prompt, 1, SamplingParams(max_tokens=4, temperature=1.0, seed=0, stop=[]))
            sync()
            t0 = time.perf_counter()
            futures = [sc.sample(prompt, args.samples, params.model_copy(update={"seed": 1 + i})) for i in range(args.requests)]
            outs = [await f for f in futures]
            dt = time.perf_counter() - t0
            n = sum(len(s.tokens) for o in outs for s in o.sequences)
            row(
                f"{shape}: torch sampler",
                f"{n / dt:,.0f} tok/s",
                f"{args.requests} requests x {args.samples} samples x {args.sample_tokens} tokens",
            )
            seqd = outs[0].sequences[0]
            trainer = await sc.compute_logprobs(prompt + seqd.tokens)
            diffs = [abs(a - b) for a, b in zip(seqd.logprobs, trainer[len(prompt) :]) if b is not None]
            row(
                f"{shape}: sampler vs trainer log-prob",
                f"max {max(diffs):.4f}",
                f"mean {statistics.fmean(diffs):.5f} over {len(diffs)} tokens ({args.dtype})",
            )
            alone = await sc.sample(prompt, args.samples, params)  # the same request, decoded on its own
            same = [s.tokens for s in alone.sequences] == [s.tokens for s in outs[0].sequences]
            row(f"{shape}: seeded sample batch-invariant", "yes" if same else "no", f"seed 1 alone vs in a batch of {args.requests}")
        except Exception as err:
            row(f"{shape}: sampling", f"FAILED {type(err).__name__}", str(err)[:160])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="for the benchmarks; the suite runs in float32 and bfloat16")
    p.add_argument("--models", default="qwen2.5-0.5b,llama-8b", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--suite", default="core", choices=["core", "full", "none"], help="which part of the local suite to run on the device")
    p.add_argument("--suite-timeout", type=float, default=150.0, help="seconds per suite run")
    p.add_argument("--budgets", default="2048,8192,16384", help="token budgets to time")
    p.add_argument("--oom-budget", type=int, default=262144, help="a budget too large for the memory fraction")
    p.add_argument("--memory-fraction", type=float, default=0.6)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--sample-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu_check.json (default $OUT)")
    p.add_argument("--no-bootstrap", action="store_true", help="run in this environment as it is")
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the wheels to bootstrap from (bench/gpu_wheels.sh)")
    args = p.parse_args()
    args.budgets = [int(b) for b in args.budgets.split(",")]

    if not args.no_bootstrap and not os.environ.get("ASYNCSESS_GPU_CHECK_READY"):
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=bootstrap(args.wheels)).returncode)

    import torch

    row("device", torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu", f"torch {torch.__version__}")
    import peft
    import transformers

    row("versions", f"transformers {transformers.__version__}, peft {peft.__version__}", f"python {sys.version.split()[0]}")
    if args.suite != "none":
        for dtype in ("float32", "bfloat16"):
            run_suite(args.device, dtype, args.suite, args.suite_timeout)

    import anyio

    patch_loader()
    with tempfile.TemporaryDirectory(prefix="asyncsess-gpu-check-") as tmp:
        for shape in [m for m in args.models.split(",") if m]:
            try:
                anyio.run(bench_model, shape, args, Path(tmp))
            except Exception as err:
                row(f"{shape}", f"FAILED {type(err).__name__}", str(err)[:200])
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    width = max(len(c) for c, _, _ in ROWS)
    print("\n| check | result | note |\n|---|---|---|")
    for check, result, note in ROWS:
        print(f"| {check.ljust(width)} | {result} | {note} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
