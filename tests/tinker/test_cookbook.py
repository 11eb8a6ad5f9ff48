"""tinker-cookbook 0.5.8's own training entry points, unmodified, against ``asyncsess serve`` on mock://.

Configuration only: the base URL, the model path and the renderer. The model path is a local directory
holding mock://'s character tokenizer in Hugging Face form (``model_name`` doubles as the tokenizer path in
the cookbook, and mock:// accepts any base-model name), so the cookbook's ``get_tokenizer`` loads it offline
and every token id fits the mock model. Runs in the ``cookbook`` nox session (the cookbook pins its own
transformers and torch).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import tinker_cookbook as cookbook

from .conftest import API_KEY, start_server

pytestmark = pytest.mark.cookbook


@pytest.fixture(scope="module")
def server():
    yield from start_server("mock://?max_context=4096&default_max_tokens=16", poll_timeout=10.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """mock://'s tokenizer as a Hugging Face tokenizer directory (same ids, same text)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from asyncsess_mock.tokenizer import CharTokenizer

    char = CharTokenizer()
    vocab = {piece: i for i, piece in enumerate(char.pieces)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=char.unk_token))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    specials = [p for p in char.pieces[: len(char.all_special_ids)]]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=char.bos_token,
        eos_token=char.eos_token,
        unk_token=char.unk_token,
        pad_token=char.pad_token,
        additional_special_tokens=[s for s in specials if s not in {char.bos_token, char.eos_token, char.unk_token, char.pad_token}],
    )
    out = tmp_path_factory.mktemp("mock-char-tokenizer")
    fast.save_pretrained(out)
    text = "User: What is 4 + 5?\n"
    assert fast.encode(text, add_special_tokens=False) == char.encode(text, add_special_tokens=False)
    return str(out)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_cookbook_supervised_train(server, model_dir: str, tmp_path: Path) -> None:
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_dir,
        renderer_name="role_colon",
        max_length=1024,
        batch_size=16,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = train.Config(
        log_path=str(tmp_path / "sl"),
        model_name=model_dir,
        recipe_name="asyncsess_ci_sl",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
        learning_rate=2e-2,
        lr_schedule="constant",
        lora_rank=8,
        base_url=server.url,
        max_steps=6,
        eval_every=0,
        save_every=0,
    )
    asyncio.run(train.main(config))
    rows = [r for r in _metrics(tmp_path / "sl") if "train_mean_nll" in r]
    assert len(rows) >= 6, rows
    nll = [r["train_mean_nll"] for r in rows]
    assert all(math.isfinite(x) for x in nll)
    assert nll[-1] < nll[0], nll


def test_cookbook_rl_train_arithmetic(server, model_dir: str, tmp_path: Path) -> None:
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    config = train.Config(
        learning_rate=5e-2,
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=4, model_name_for_tokenizer=model_dir, renderer_name="role_colon", n_batches=4, group_size=4
        ),
        model_name=model_dir,
        recipe_name="asyncsess_ci_rl",
        renderer_name="role_colon",
        max_tokens=8,
        log_path=str(tmp_path / "rl"),
        base_url=server.url,
        lora_rank=8,
        eval_every=0,
        save_every=0,
    )
    asyncio.run(train.main(config))
    rows = _metrics(tmp_path / "rl")
    steps = [r for r in rows if any(k.startswith("env/") for k in r)]
    assert len(steps) >= 4, rows
    assert all(math.isfinite(r["env/all/reward/total"]) for r in steps)
    assert server.door.sessions, "the cookbook talked to this server"
