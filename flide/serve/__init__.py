"""`flide serve`: the System One HTTP server (FastAPI + uvicorn) with continuous rounds.

    from flide.serve import create_app, run_server
    run_server(create_app(engine, "my-model"), host="127.0.0.1", port=8000)

app.py (endpoints, errors), scheduler.py (the model thread and its rounds), body.py (body checks on top of
`Engine.prepare`), metrics.py (Prometheus), schema.py (pydantic models for the OpenAPI schema), logs.py.
"""

from .app import create_app, model_name_of, run_server
from .scheduler import Overloaded, Scheduler

__all__ = ["Overloaded", "Scheduler", "create_app", "model_name_of", "run_server"]
