"""tinker-cookbook 0.5.8's minimal loops (``recipes/sl_loop.py``, ``recipes/rl_loop.py``) and completers on
asyncsess's own client, ported as docs/compatibility.md says: ``import tinker`` becomes
``import asyncsess.sync as tinker`` and the ``ServiceClient(...)`` line takes the backend URL. The loops are
read from the installed cookbook and run unmodified otherwise; the cookbook's helpers they call
(renderers, ``conversation_to_datum``, ``checkpoint_utils.save_checkpoint``) still build Tinker's own types
and call the ``*_async`` methods Tinker's blocking clients have. The Hugging Face datasets they load are
replaced by local rows (offline), and the recommended renderer of the mock tokenizer is ``role_colon``.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest
import tinker_cookbook as cookbook

from .test_cookbook import _env, _metrics, model_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.cookbook

MOCK = "mock://?max_context=4096"


def _port(monkeypatch: pytest.MonkeyPatch, name: str, *, keep_tinker_types: bool = False) -> types.ModuleType:
    """The cookbook's ``recipes/<name>.py`` with its ``tinker`` imports and ServiceClient line ported."""
    path = Path(cookbook.__file__).parent / "recipes" / f"{name}.py"
    src = path.read_text().replace("import tinker\n", "import asyncsess.sync as tinker\n")
    if not keep_tinker_types:
        src = src.replace("from tinker import types\n", "from asyncsess.sync import types\n")
    src, n = re.subn(r"tinker\.ServiceClient\(\s*base_url=config\.base_url,", "tinker.ServiceClient(config.base_url,", src)
    assert n == 1, "the loop's ServiceClient line changed"
    mod = types.ModuleType(f"ported_{name}")
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # chz reads its classes' module
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


@pytest.fixture
def closes_services():
    """The loops never close their ServiceClient (Tinker's needs no closing): close what they left open."""
    from asyncsess import _facade

    yield
    _facade.shutdown()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, closes_services):
    """Serve ``datasets.load_dataset`` from given rows, and name role_colon as the mock tokenizer's renderer."""
    import datasets
    from tinker_cookbook import model_info

    monkeypatch.setattr(model_info, "get_recommended_renderer_name", lambda name: "role_colon")

    def serve(rows: list[dict]) -> None:
        train = datasets.Dataset.from_list(rows)
        monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.DatasetDict({"train": train}))

    return serve


def _conversations() -> list[dict]:
    path = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]


def test_ported_sl_loop_saves_and_resumes(model_dir: str, offline, monkeypatch, tmp_path: Path) -> None:  # noqa: F811
    """conversation_to_datum's Tinker Datums are taken, checkpoint_utils.save_checkpoint (asyncio.run over
    save_state_async / result_async) saves, and a rerun resumes at the checkpoint's batch with its weights."""
    offline(_conversations())
    loop = _port(monkeypatch, "sl_loop")

    def config(max_steps: int):
        return loop.Config(
            base_url=MOCK, log_path=str(tmp_path), model_name=model_dir, batch_size=8, learning_rate=2e-2,
            lora_rank=8, save_every=2, max_steps=max_steps, max_length=1024,
        )  # fmt: skip

    loop.main(config(3))
    first = _records(tmp_path)
    assert [r["name"] for r in first] == ["000002", "final"]
    assert first[0]["batch"] == 2 and first[0]["state_path"].endswith("/weights/000002")
    # as if the loop had been killed after its step-2 checkpoint: the last record is that checkpoint
    (tmp_path / "checkpoints.jsonl").write_text(json.dumps(first[0]) + "\n")
    loop.main(config(5))
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 2, 3, 4]
    nll = [r["train_mean_nll"] for r in rows]
    assert all(math.isfinite(x) for x in nll)
    assert nll[3] == nll[2], "the resumed step 2 sees the weights saved before step 2 (mock:// is deterministic)"
    assert [r["name"] for r in _records(tmp_path)] == ["000002", "000002", "000004", "final"]


def _stub_math_rl(monkeypatch: pytest.MonkeyPatch) -> None:
    """rl_loop imports its reward helpers from the math-rl extra (sympy, math-verify), not installed here.
    The stand-in rewards a response that contains an "e" (a mixed reward in most groups)."""
    grading = types.ModuleType("tinker_cookbook.recipes.math_rl.math_grading")
    grading.extract_boxed = lambda text: text  # type: ignore[attr-defined]
    grading.grade_answer = lambda given, truth: "e" in given  # type: ignore[attr-defined]
    env = types.ModuleType("tinker_cookbook.recipes.math_rl.math_env")
    env.extract_gsm8k_final_answer = lambda answer: answer.split("####")[-1].strip()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, grading.__name__, grading)
    monkeypatch.setitem(sys.modules, env.__name__, env)


def test_ported_rl_loop_takes_tinker_types(model_dir: str, offline, monkeypatch, tmp_path: Path) -> None:  # noqa: F811
    """rl_loop appends to the renderer's Tinker ModelInput, so its ``types`` stay Tinker's (Tinker's
    ModelInput refuses another library's chunk): asyncsess's client takes Tinker's Datum, TensorData
    (from_torch) and AdamParams, and the steps with mixed rewards train."""
    _stub_math_rl(monkeypatch)
    offline([{"question": f"What is {a} + {a}?", "answer": f"#### {2 * a}"} for a in range(32)])
    loop = _port(monkeypatch, "rl_loop", keep_tinker_types=True)
    loop.main(
        loop.Config(
            base_url=MOCK,
            log_path=str(tmp_path),
            model_name=model_dir,
            batch_size=4,
            group_size=4,
            learning_rate=5e-2,
            lora_rank=8,
            save_every=2,
            max_steps=3,
            max_tokens=8,
        )  # fmt: skip
    )
    rows = _metrics(tmp_path)
    assert len(rows) == 3 and all(0 <= r["reward/total"] <= 1 for r in rows)
    trained = [r["grad_norm"] for r in rows if "grad_norm" in r]  # steps with a group of mixed rewards
    assert trained and all(math.isfinite(g) and g > 0 for g in trained), rows
    assert [r["name"] for r in _records(tmp_path)] == ["000002", "final"]


def test_completers_on_asyncsess_sync_sampler(model_dir: str) -> None:  # noqa: F811
    """The cookbook's TinkerTokenCompleter / TinkerMessageCompleter await ``sample_async`` of a blocking
    SamplingClient from their own event loop."""
    from tinker_cookbook import renderers
    from tinker_cookbook.completers import TinkerMessageCompleter, TinkerTokenCompleter
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    import asyncsess.sync as tinker

    renderer = renderers.get_renderer("role_colon", get_tokenizer(model_dir))
    convo = [{"role": "user", "content": "What is 2 + 2?"}]
    with tinker.ServiceClient(MOCK) as svc:
        sampler = svc.create_lora_training_client(model_dir, rank=8).save_weights_and_get_sampling_client()

        async def complete():
            prompt = renderer.build_generation_prompt(convo)
            tokens = await TinkerTokenCompleter(sampler, max_tokens=8)(prompt, renderer.get_stop_sequences())
            message = await TinkerMessageCompleter(sampler, renderer, max_tokens=8)(convo)
            return prompt, tokens, message

        prompt, tokens, message = asyncio.run(complete())
        assert 1 <= len(tokens.tokens) <= 8 and len(tokens.logprobs) == len(tokens.tokens)
        assert all(lp <= 0 for lp in tokens.logprobs)
        scored = sampler.compute_logprobs(prompt.to_ints() + tokens.tokens).result()[prompt.length :]
        assert tokens.logprobs == pytest.approx(scored, abs=1e-4), "the sampler's own log-probs of the completion"
        assert message["role"] == "assistant" and isinstance(message["content"], str)


def test_decisions_probability_loss_on_asyncsess_client(model_dir: str) -> None:  # noqa: F811
    """The decisions recipe's training (its module docstring's calls) on asyncsess's client:
    ``decision_dist_datums`` carry (N, K) targets (one per choice) into ``forward_backward_custom``, whose
    loss sees (N, K) log-probs; ``sample_decision`` reads ``target_prompt_logprobs`` given as Tinker's CSR
    TensorData. Training toward one choice raises its probability."""
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.decisions.decision import Decision, DecisionRenderer, sample_decision
    from tinker_cookbook.recipes.decisions.train import decision_dist_datums, probability_loss
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    import asyncsess.sync as tinker

    decisions = DecisionRenderer(renderers.get_renderer("role_colon", get_tokenizer(model_dir)))
    decision = Decision("Is the sky blue?", [("A", "yes"), ("B", "no"), ("C", "maybe")])
    datums = decision_dist_datums(decisions, [(decision, {"B": 1.0})])
    assert len(datums[0].loss_fn_inputs["target_tokens"].shape) == 2
    loss = probability_loss(lambda probs, target: ((probs - target) ** 2).sum())
    with tinker.ServiceClient(MOCK) as svc:
        tc = svc.create_lora_training_client(model_dir, rank=8)

        async def train() -> tuple[dict, dict, list[float]]:
            before = await sample_decision(await tc.save_weights_and_get_sampling_client_async(), decisions.render(decision))
            losses = []
            for _ in range(3):
                step = await tc.forward_backward_custom_async(datums, loss)
                await (await tc.optim_step_async(tinker.AdamParams(learning_rate=0.1))).result_async()
                losses.append((await step.result_async()).metrics["loss:sum"])
            after = await sample_decision(await tc.save_weights_and_get_sampling_client_async(), decisions.render(decision))
            return before, after, losses

        before, after, losses = asyncio.run(train())
    assert sum(before.values()) == pytest.approx(1) and sum(after.values()) == pytest.approx(1)
    assert after["B"] > before["B"] and losses[-1] < losses[0], (before, after, losses)
    assert losses[0] == pytest.approx((before["A"] ** 2 + (before["B"] - 1) ** 2 + before["C"] ** 2), rel=1e-4)
