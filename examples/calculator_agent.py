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
MAX_EXPR = 1000  # characters: a longer expression is refused before it is parsed
MAX_VALUE = 1e100  # a number, or any intermediate result, beyond this in magnitude is refused


def calc(expr: str) -> str:
    """Evaluate + - * / on numbers, nothing else. Every outcome is a short string: the value, or ``error: ...``
    for bad syntax, another operation (``**``, names, calls, attributes), division by zero, an expression
    longer than MAX_EXPR characters, or a number beyond MAX_VALUE (checked at each step, so nothing grows)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            value = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.operand))
        else:
            raise ValueError("only numbers and + - * /")
        if not abs(value) <= MAX_VALUE:  # also NaN; an int compares with the float exactly, without overflow
            raise ValueError(f"a number beyond {MAX_VALUE:g}")
        return value

    if len(expr) > MAX_EXPR:
        return f"error: the expression is longer than {MAX_EXPR} characters"
    try:
        value = ev(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError) as err:  # MemoryError: the parser's stack
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
            except (ValueError, AttributeError, RecursionError):
                expr = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calc(str(expr))})
    return (reply.content or "") if reply is not None else ""
