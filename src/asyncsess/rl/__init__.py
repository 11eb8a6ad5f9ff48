"""The RL library: envs and their groups (:mod:`.types`), single-turn problems as one-step envs
(:mod:`.problem_env`), datasets that save their position (:mod:`.datasets`), chat episodes with tools
(:mod:`.tool_env`), playing groups (:mod:`.rollouts`), advantages and datums (:mod:`.data`), THE loop
(:mod:`.train`), and RL for OpenAI-speaking agents (:mod:`.agent`, :mod:`.capture`). A recipe imports from here."""

from ..chat import ChatRenderer, Tool, ToolCall, parse_tool_calls
from ..serve.capture import CapturedCall, CaptureStore
from .agent import Agent, AgentGroupBuilder, AgentRLConfig, train_agent_rl
from .capture import AgentTrajectory, build_trajectory, read_trajectories
from .data import center_advantages, group_datums, is_constant, kl_penalty, rl_datum, sample_train_kl, sft_datum, trajectory_datums
from .datasets import ShuffledDataset
from .problem_env import Grader, Problem, ProblemDataset, ProblemEnv, ProblemGroupBuilder, PromptRenderer, problem_datasets
from .rollouts import SamplerCompleter, ScriptedCompleter, do_group_rollout, do_rollout, rollout_metrics
from .tool_env import ToolEnv
from .train import MakeCompleter, MakeDatasets, PlayGroup, RLConfig, RLResult, train_rl
from .types import (
    STOP_REASONS,
    Action,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    StatefulDataset,
    StepResult,
    StopCondition,
    TokenCompleter,
    TokensWithLogprobs,
    Trajectory,
    TrajectoryGroup,
    Transition,
)

__all__ = [
    "Action",
    "Agent",
    "AgentGroupBuilder",
    "AgentRLConfig",
    "AgentTrajectory",
    "CaptureStore",
    "CapturedCall",
    "ChatRenderer",
    "Env",
    "EnvGroupBuilder",
    "Grader",
    "MakeCompleter",
    "MakeDatasets",
    "Observation",
    "PlayGroup",
    "Problem",
    "ProblemDataset",
    "ProblemEnv",
    "ProblemGroupBuilder",
    "PromptRenderer",
    "RLConfig",
    "RLDataset",
    "RLResult",
    "STOP_REASONS",
    "SamplerCompleter",
    "ShuffledDataset",
    "StatefulDataset",
    "ScriptedCompleter",
    "StepResult",
    "StopCondition",
    "TokenCompleter",
    "TokensWithLogprobs",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "Trajectory",
    "TrajectoryGroup",
    "Transition",
    "build_trajectory",
    "center_advantages",
    "do_group_rollout",
    "do_rollout",
    "group_datums",
    "is_constant",
    "kl_penalty",
    "parse_tool_calls",
    "problem_datasets",
    "read_trajectories",
    "rl_datum",
    "rollout_metrics",
    "sample_train_kl",
    "sft_datum",
    "train_agent_rl",
    "train_rl",
    "trajectory_datums",
]
