"""The OpenAI-compatible HTTP API over the cluster (FastAPI; pydantic lives only here)."""
