"""The RL library: environments, rollouts, advantages and datums, and the training loops."""
