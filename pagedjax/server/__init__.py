"""The OpenAI-compatible HTTP server (`pagedjax serve`): protocol models, the FastAPI app and
the handlers of the completions and chat endpoints."""
