"""OpenAI-compatible HTTP frontend component."""
