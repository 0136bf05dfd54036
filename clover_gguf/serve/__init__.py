"""`clover-gguf serve`: an OpenAI-compatible HTTP server on a Clover model, one module per concern.

  app      the routes, the request flow, create_app and serve (uvicorn)
  schema   OpenAI's request bodies and error shape; a request -> the Plan a worker runs
  slots    the model work on worker threads: Plan, Job, the slot pool and its FIFO
  metrics  the Prometheus counters of /metrics
  auth     the API key and loopback hosts
  page     the chat page at / (its files are static/: plain HTML, CSS and JavaScript, no build step)
"""

from clover_gguf.serve.app import create_app, load_runtimes, serve

__all__ = ["create_app", "load_runtimes", "serve"]
