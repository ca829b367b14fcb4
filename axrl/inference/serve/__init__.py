"""`axrl serve`: an SGLang-compatible HTTP server (plus OpenAI endpoints) over the embedded engine.

- `state`: `ServeConfig`, `AxrlServer` (the engine, tokenizer, /generate parsing, weight sync)
  and `build_server`;
- `app`: `create_app`, the FastAPI app, from the route groups `sglang_routes`,
  `weight_routes` and `openai_routes`;
- `main`: `serve`, the `axrl serve` process.
"""

from axrl.inference.serve.serve_app import create_app
from axrl.inference.serve.main import serve, startup_message
from axrl.inference.serve.state import AxrlServer, ServeConfig, build_server

__all__ = ["AxrlServer", "ServeConfig", "build_server", "create_app", "serve", "startup_message"]
