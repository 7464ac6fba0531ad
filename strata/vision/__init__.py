"""Image input for the vision tower of qwen4exp models."""
