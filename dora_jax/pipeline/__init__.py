"""Assembly of a real run: prompts, the GRPO trainer adapter, engines and the runtime."""
