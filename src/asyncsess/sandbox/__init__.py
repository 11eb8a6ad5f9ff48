"""Sandboxed code execution for code RL: one interface, a local implementation and a SandboxFusion client."""

from asyncsess.sandbox.base import BaseSandbox, Files, Sandbox
from asyncsess.sandbox.fusion import SandboxFusionClient
from asyncsess.sandbox.local import Isolation, LocalSandbox
from asyncsess.sandbox.results import ExecutionResult, ExecutionStatus, TestCase, TestReport, TestResult, outputs_match

__all__ = [
    "BaseSandbox",
    "ExecutionResult",
    "ExecutionStatus",
    "Files",
    "Isolation",
    "LocalSandbox",
    "Sandbox",
    "SandboxFusionClient",
    "TestCase",
    "TestReport",
    "TestResult",
    "outputs_match",
]
