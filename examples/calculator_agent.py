"""A plain function-calling agent with a calculator tool. It knows nothing of asyncsess: it imports only
``openai`` (and the standard library) and runs against any OpenAI-compatible endpoint."""

from __future__ import annotations

import ast
import json
import operator

import openai

SYSTEM = "Answer the arithmetic question. You may call calc. End with: Answer: <number>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression with + - * /.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv, ast.USub: operator.neg}


def calc(expr: str) -> str:
    """Evaluate + - * / on numbers, nothing else."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * /")

    try:
        value = ev(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as err:
        return f"error: {err}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def solve(client: openai.AsyncOpenAI, question: str, model: str = "policy", max_turns: int = 3) -> str:
    """Ask, run the calculator calls the model makes, and return its final reply."""
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = None
    for _ in range(max_turns):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=48)
        reply = response.choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            try:
                expr = json.loads(call.function.arguments).get("expr", "")
            except (ValueError, AttributeError):
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(expr))})
    return (reply.content or "") if reply is not None else ""
