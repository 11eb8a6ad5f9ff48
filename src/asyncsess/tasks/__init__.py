"""Single-turn tasks for the RL recipes: problem generators or loaders, and their graders."""
