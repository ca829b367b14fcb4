"""A launched server that fails a request: the client's error quotes the server's own last lines
(the HTTP 500 body rarely says why), for SGLang's client and vLLM's, with the output kept in
memory (no `log_dir`) or in a log file, also when the failing process died and was restarted by
the retry (then the dead process's lines are quoted too). The servers are a small fake whose
output this test writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from axrl.inference import GenerateRequest, SamplingParams
from axrl.inference.remote.launcher import ServerLauncher, free_port
from axrl.inference.remote.transport import ServerUnavailable
from axrl.inference.sglang import SGLangEngine
from axrl.inference.vllm.client import VLLMEngine

# Serves GET (health, model info) with 200; answers every POST with a 500 after printing a
# traceback's last line, as vLLM's API server does when its engine core died; `--die` exits after.
FAKE = r'''
import http.server, json, os, sys
port = int(sys.argv[sys.argv.index('--port') + 1])
die = '--die' in sys.argv
print('fake server: loading weights', flush=True)
class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()
    def do_GET(self):
        self._answer(200, {'weight_version': '0'})
    def do_POST(self):
        self.rfile.read(int(self.headers.get('Content-Length', 0)))
        print('  File "gpu_model_runner.py", line 3, in _bookkeeping_sync', flush=True)
        print('RuntimeError: CPU Generator does not use offset', file=sys.stderr, flush=True)
        for k in range(60):   # each failed request's own traceback, as vLLM's API server prints them
            print(f'(APIServer) ERROR [vllm_error.py:54] request {k} failed: EngineDeadError', flush=True)
        self._answer(500, {'message': 'EngineCore encountered an issue. See stack trace for the root cause.'})
        if die:
            os._exit(3)
    def log_message(self, *args):
        pass
http.server.HTTPServer(('127.0.0.1', port), Handler).serve_forever()
'''


@pytest.mark.parametrize("engine_cls,log,die", [(SGLangEngine, False, True), (VLLMEngine, False, False),
                                                (VLLMEngine, True, True)])
def test_a_failed_request_quotes_the_servers_last_lines(tmp_path: Path, engine_cls, log, die) -> None:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    launcher = ServerLauncher(tmp_path, command=[sys.executable, str(script)], base_port=free_port(),
                              server_args=["--die"] if die else [], startup_timeout_s=60,
                              log_dir=tmp_path / "logs" if log else None)
    launcher.start()
    engine = engine_cls(launcher.urls, launcher=launcher, own_launcher=False, retries=1, backoff_s=0.01)
    try:
        with pytest.raises(ServerUnavailable) as info:
            engine.generate_batch([GenerateRequest(input_ids=[1, 2, 3],
                                                   sampling_params=SamplingParams(max_new_tokens=2, seed=1))])
    finally:
        engine.shutdown()
        launcher.stop()
    message = str(info.value)
    assert "HTTP 500: EngineCore encountered an issue" in message          # the answer's body
    # the root cause, although the 60 lines after it push it out of the last 30
    assert "the first errors it printed:\nRuntimeError: CPU Generator does not use offset" in message
    assert "request 59 failed" in message and "its last output:" in message
    assert "server 0 (http://127.0.0.1:" in message
    if die:   # the first attempt killed it, the retry restarted it: both processes' ends are quoted
        assert "1 restart(s)" in message and "its previous process (exit code 3) ended with" in message
        assert message.count("request 59 failed") == 2
    if log:
        assert str(tmp_path / "logs" / "server_0.log") in message
