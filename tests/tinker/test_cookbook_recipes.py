"""More of tinker-cookbook 0.5.8, unmodified, against ``asyncsess serve`` on mock:// (as test_cookbook.py):
DPO, SDFT's top-K distillation, on-policy distillation from a trained teacher, a multi-turn env, and
supervised training resumed from its last checkpoint after the process running it was killed.
Configuration only, plus small local datasets where a recipe would download one."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import chz
import pytest
import tinker_cookbook as cookbook

from .test_cookbook import _env, _metrics, model_dir, server  # noqa: F401 (fixtures)

pytestmark = pytest.mark.cookbook


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]


def test_dpo_loss_starts_at_log2_and_falls(server, model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """train_dpo: the reference is the initial weights, so step 0 is exactly ln 2 with margin 0; then the
    loss falls and the chosen answers win (the cookbook's metric names)."""
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = tmp_path / "comparisons.jsonl"
    rows = []
    for a in range(32):
        prompt = [{"role": "user", "content": f"What is {a % 10} + {a // 10}?"}]
        chosen = [{"role": "assistant", "content": str(a % 10 + a // 10)}]
        rejected = [{"role": "assistant", "content": "I do not know."}]
        comparison = {"prompt_conversation": prompt, "completion_A": chosen, "completion_B": rejected}
        rows.append(json.dumps({"comparison": comparison, "label": "A"}))
    data.write_text("\n".join(rows) + "\n")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model_dir, renderer_name="role_colon", max_length=512, batch_size=8)
    builder = DPODatasetBuilderFromComparisons(common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=str(data)))
    log = tmp_path / "dpo"
    train_dpo.main(
        train_dpo.Config(
            log_path=str(log),
            model_name=model_dir,
            renderer_name="role_colon",
            recipe_name="asyncsess_ci_dpo",
            dataset_builder=builder,
            learning_rate=2e-2,
            lr_schedule="constant",
            dpo_beta=0.1,
            lora_rank=8,
            base_url=server.url,
            max_steps=4,
            save_every=2,
            eval_every=0,
        )  # fmt: skip
    )
    rows = _metrics(log)
    loss = [r["dpo_loss"] for r in rows]
    assert len(loss) == 4 and loss[0] == pytest.approx(math.log(2), abs=1e-6) and rows[0]["margin"] == 0
    assert loss == sorted(loss, reverse=True) and loss[-1] < loss[0], loss
    assert rows[-1]["accuracy"] == 1.0 and rows[-1]["chosen_reward"] > rows[-1]["rejected_reward"]
    assert [r["name"] for r in _records(log)] == ["000002", "final"]


def test_sdft_topk_distillation(server, model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """SDFT (top-K forward KL): the teacher's ``topk_prompt_logprobs`` become (N, K) cross-entropy targets."""
    from tinker_cookbook import renderers
    from tinker_cookbook.distillation import sdft
    from tinker_cookbook.recipes.sdft.datasets import SDFTDataset
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    renderer = renderers.get_renderer("role_colon", get_tokenizer(model_dir))
    questions, answers = [f"What is {a} + {a}?" for a in range(8)], [str(2 * a) for a in range(8)]
    log = tmp_path / "sdft"
    config = sdft.Config(
        model_name=model_dir, recipe_name="asyncsess_ci_sdft", renderer_name="role_colon", lora_rank=8,
        base_url=server.url, learning_rate=2e-2, max_tokens=8, topk=5, eval_every=0, save_every=0,
        log_path=str(log), max_steps=2, max_context_length=4096,
    )  # fmt: skip
    asyncio.run(sdft.main(config, SDFTDataset(questions, answers, batch_size=4, group_size=2, renderer=renderer)))
    rows = _metrics(log)
    assert len(rows) == 2
    for r in rows:
        assert r["sdft/topk"] == 5 and r["sdft/num_datums"] == 8 and r["sdft/teacher_truncated_count"] == 0
        assert 0 < r["sdft/mean_teacher_entropy"] < math.log(5) + 1e-6  # entropy of a top-5 distribution
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0


def test_on_policy_distillation_from_a_trained_teacher(server, model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """train_on_policy with a teacher sampler opened on another run's sampler weights: the student's
    samples are scored by the teacher's ``compute_logprobs``, and the KL is logged under the cookbook's names."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
    from tinker_cookbook.rl.types import RLDatasetBuilder
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tokenizer = get_tokenizer(model_dir)
    renderer = renderers.get_renderer("role_colon", tokenizer)
    prompts = [f"What is {a} + {a}?" for a in range(8)]
    convos = [[{"role": "user", "content": p}, {"role": "assistant", "content": "eeee"}] for p in prompts]
    teacher = tinker.ServiceClient(base_url=server.url).create_lora_training_client(base_model=model_dir, rank=8)
    data = [conversation_to_datum(c, renderer, 512) for c in convos]
    for _ in range(8):
        teacher.forward_backward(data, "cross_entropy")
        teacher.optim_step(tinker.AdamParams(learning_rate=0.1)).result()
    teacher_path = teacher.save_weights_for_sampler("teacher").result().path

    @chz.chz
    class Prompts(RLDatasetBuilder):
        async def __call__(self):
            return PromptOnlyDataset(prompts, batch_size=2, group_size=2, renderer=renderer, tokenizer=tokenizer), None

    log = tmp_path / "opd"
    dataset = DistillationDatasetConfig(
        dataset_builder=Prompts(),
        teacher_config=TeacherConfig(base_model=model_dir, load_checkpoint_path=teacher_path),
        groups_per_batch=2,
    )
    config = train_on_policy.Config(
        learning_rate=5e-2, model_name=model_dir, recipe_name="asyncsess_ci_opd", renderer_name="role_colon",
        max_tokens=8, dataset_configs=[dataset], lora_rank=8, base_url=server.url, log_path=str(log),
        eval_every=0, save_every=2, max_steps=3,
    )  # fmt: skip
    asyncio.run(train_on_policy.main(config))
    rows = _metrics(log)
    assert len(rows) == 3
    assert all(math.isfinite(r["teacher_kl"]) and r["teacher_kl/dataset_0"] == pytest.approx(r["teacher_kl"]) for r in rows)
    assert any(r["teacher_kl"] != 0 for r in rows), "the teacher's weights differ from the student's"
    assert [r["name"] for r in _records(log)] == ["000002", "final"]


def test_multi_turn_guess_number(server, model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """The guess-the-number env: ten turns per episode, each a sample on the growing conversation."""
    from tinker_cookbook.recipes.multiplayer_rl.guess_number.env import GuessNumberDatasetBuilder
    from tinker_cookbook.rl import train

    log = tmp_path / "guess"
    builder = GuessNumberDatasetBuilder(
        batch_size=2, model_name=model_dir, renderer_name="role_colon", train_group_size=2, test_group_size=1
    )
    config = train.Config(
        model_name=model_dir, recipe_name="asyncsess_ci_guess", renderer_name="role_colon", log_path=str(log),
        dataset_builder=builder, learning_rate=5e-2, max_tokens=8, eval_every=0, save_every=0, max_steps=2,
        base_url=server.url, lora_rank=8,
    )  # fmt: skip
    asyncio.run(train.main(config))
    rows = _metrics(log)
    assert len(rows) == 2
    for r in rows:
        assert r["env/all/total_turns"] > 4, "episodes go on past their first turn"
        assert 1 <= r["env/all/turns_per_episode"] <= 10 and math.isfinite(r["env/all/reward/total"])
        assert r["env/all/ob_tokens_per_turn"] > 100  # the system prompt and the history


def _sl_config(url: str, model: str, log: str, max_steps: str | int):
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name="role_colon", max_length=1024, batch_size=8,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )  # fmt: skip
    return train.Config(
        log_path=log, model_name=model, recipe_name="asyncsess_ci_sl", renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
        learning_rate=2e-2, lr_schedule="constant", lora_rank=8, base_url=url, max_steps=int(max_steps), eval_every=0,
        save_every=2,
    )  # fmt: skip


def test_supervised_resumes_after_the_loop_is_killed(server, model_dir: str, tmp_path: Path) -> None:  # noqa: F811
    """supervised.train in a child process (16 steps), killed (SIGKILL) once its step-2 checkpoint is
    recorded; run again on the log dir, it resumes from the last checkpoint with its optimizer at the recorded
    batch and finishes. The resumed step's loss is that of the checkpoint's weights on that batch (0.5.8 saves
    a step's checkpoint after submitting that step, so the batch is trained twice: a cookbook quirk)."""
    import tinker
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.common import compute_mean_nll

    log = tmp_path / "sl"
    log.mkdir()
    code = (
        "import asyncio, sys; from tests.tinker.test_cookbook_recipes import _sl_config; "
        "from tinker_cookbook.supervised import train; asyncio.run(train.main(_sl_config(*sys.argv[1:])))"
    )
    root = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", code, server.url, model_dir, str(log), "16"],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    checkpoints = log / "checkpoints.jsonl"
    while child.poll() is None and '"000002"' not in (checkpoints.read_text() if checkpoints.exists() else ""):
        time.sleep(0.05)
    child.kill()
    child.wait()
    saved = _records(log)
    assert saved and "final" not in [r["name"] for r in saved], "killed before the end"
    last = saved[-1]["batch"]
    killed_steps = len(_metrics(log))

    config = _sl_config(server.url, model_dir, str(log), last + 2)
    asyncio.run(train.main(config))
    resumed = _metrics(log)[killed_steps:]
    assert [r["step"] for r in resumed] == [last, last + 1]
    assert [r["name"] for r in _records(log)][len(saved) :] == [saved[-1]["name"], "final"]

    dataset, _ = config.dataset_builder()
    dataset.set_epoch(seed=0)
    batch = dataset.get_batch(last)
    client = tinker.ServiceClient(base_url=server.url).create_training_client_from_state(saved[-1]["state_path"])
    out = client.forward(batch, "cross_entropy").result()
    expected = compute_mean_nll([o["logprobs"] for o in out.loss_fn_outputs], [d.loss_fn_inputs["weights"] for d in batch])
    assert resumed[0]["train_mean_nll"] == pytest.approx(expected, rel=1e-6)
