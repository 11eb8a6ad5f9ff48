"""code_rl on local:// with the tiny random Llama (CPU): a few steps end to end (learning is not required).

Half of the first turns are sampled by the model itself (a random model writes no code: reward -0.1), the
rest are scripted (tool calls, right and wrong programs), so groups have different rewards and the cispo
updates go through the local engine's forward_backward and optim_step.
"""

from __future__ import annotations

import json

import pytest

from asyncsess.chat import ChatRenderer
from asyncsess.rl import ScriptedCompleter
from asyncsess.tasks import code
from examples import code_rl

from ..recipes.helpers import check_metrics_file
from .scripted import code_policy

pytestmark = [pytest.mark.anyio, pytest.mark.local]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from asyncsess_local.testing import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=2048))


async def test_code_rl_runs_on_the_tiny_local_model(tmp_path, tiny_model):
    problems = [p for p in code.load(code_rl.BUNDLED) if p.id in ("reverse-string", "uppercase", "count-words")]
    train_path = tmp_path / "problems.jsonl"
    train_path.write_text(
        "".join(
            json.dumps(
                {
                    "id": p.id,
                    "question": p.question,
                    "tests": [{"input": t.stdin, "output": t.expected_stdout} for t in p.tests],
                    "solution": p.solution,
                }
            )
            + "\n"
            for p in problems
        )
    )
    script = code_policy(problems, seed=0, sample_share=0.5)

    def make_completer(sampler, max_tokens, temperature, context_window):
        return ScriptedCompleter(sampler, script, max_tokens=max_tokens, temperature=temperature, context_window=context_window)

    run_dir = tmp_path / "run"
    args = [
        "url=local://?device=cpu",
        f"base_model={tiny_model}",
        f"train_path={train_path}",
        "n_test=1",
        "lora_rank=4",
        "lora_alpha=8",
        "learning_rate=1e-3",
        "groups_per_batch=2",
        "group_size=2",
        "num_minibatches=2",
        "max_staleness=1",
        "max_tokens=112",
        "context_window=2048",
        "max_steps=3",
        "eval_every=0",
        "save_every=2",
        f"run_dir={run_dir}",
    ]
    result = await code_rl.main(args, make_completer=make_completer)
    records = check_metrics_file(
        run_dir, {"env/all/reward/total", "env/all/turns_per_episode", "async/staleness_max", "optim/loss", "test/env/all/reward/total"}
    )
    assert result.steps == 3 and [r["step"] for r in records] == [0, 1, 2, 3]
    steps = [r for r in records if "async/staleness_max" in r]
    assert all(r["async/staleness_max"] <= 1 for r in steps)
    assert sum(r["train/datums"] for r in steps) > 0 and any("optim/loss" in r for r in steps)
    assert any(r["stop/max_tokens"] > 0 for r in steps)  # the model's own replies run to max_tokens
    assert result.final_checkpoint.final and result.final_checkpoint.step == 3


# a tool-aware template in the style of Qwen's: tools listed in the system turn, tool results in a user turn
TOOL_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|><tool_response>{{ m['content'] }}</tool_response><|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_renderer_on_hugging_face_templates(tiny_model):
    from transformers import AutoTokenizer

    from asyncsess.sandbox import LocalSandbox

    tool = code.check_solution_tool(code.load(code_rl.BUNDLED)[0], LocalSandbox())
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "R"}]
    tok = AutoTokenizer.from_pretrained(tiny_model)  # its template renders any role and ignores tools
    plain = ChatRenderer(tok)
    assert plain.tool_role and plain.stop == [tok.convert_tokens_to_ids("<|end|>")]
    text = tok.decode(plain.tokens(msgs, [tool]))
    assert text.startswith("<|system|>You can call these tools:") and text.endswith("<|tool|>R<|end|><|assistant|>")
    tok.chat_template = TOOL_TEMPLATE
    native = ChatRenderer(tok)
    text = tok.decode(native.tokens(msgs, [tool]))
    assert (
        text
        == "<|system|>tools: check_solution<|end|><|user|>q<|end|><|assistant|>a<|end|><|user|><tool_response>R</tool_response><|end|><|assistant|>"
    )
