"""`flide serve`: the System One HTTP server (FastAPI + uvicorn) with continuous rounds.

    from flide.serve import create_app, run_server
    run_server(create_app(engine, "my-model"), host="127.0.0.1", port=8000)

app.py (endpoints, errors), scheduler.py (the model thread and its rounds), body.py (body checks on top of
`Engine.prepare`), metrics.py (Prometheus), schema.py (pydantic models for the OpenAPI schema), logs.py.
"""

from __future__ import annotations

import importlib

__all__ = ["Overloaded", "Scheduler", "create_app", "model_name_of", "run_server"]
_HOMES = {"Overloaded": "scheduler", "Scheduler": "scheduler", "create_app": "app", "model_name_of": "app",
          "run_server": "app"}


def __getattr__(name: str):
    """Lazy: `Engine.submit` uses the scheduler (torch and the standard library only) without the HTTP stack, so
    in-process use must not import fastapi (whose own imports can fail on a machine set up without the server's
    dependencies: fastapi 0.165 imports opentelemetry)."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
