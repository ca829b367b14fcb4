"""The recording proxy's own CPU per call, without an engine in the way: quiet and loaded.

The proxy (`ProxyServer`) serves sessions whose engine answers at once (a stub returning a fixed
32-token reply: no model, so the only CPU on the proxy's thread is the proxy's own — parsing the
HTTP request and JSON, stitching the prompt onto the session's tokens, rendering the appended
messages, recording the turn, building and sending the reply). `--sessions` agents, one after the
other, each `--turns` chat calls (the conversation grows by the reply and a tool answer per turn),
over keep-alive `http.client` connections from a process of their own. The figure is
`ProxyServer.cpu_seconds()` (the server thread's CPU clock) over the calls.

Two servers side by side, alternating per round: AxRL's (`axrl.agents.proxy.http_server`) and
the same app under uvicorn's h11 protocol (what the proxy ran on before), so their ratio is
measured under the same load. Two conditions: *quiet* (nothing of this bench runs besides the
agents' process) and *loaded* (`--burners` processes spinning, default: one per core). The
machine's 1-minute load average before each condition is reported beside it: on a shared box
"quiet" is only as quiet as the others' jobs leave it.

Beside them, what no proxy can go below on this machine, so that the proxy's figure travels as a
ratio: two floor servers answering the same agents' calls with a fixed chat-completion reply
(`FloorServer`: `asyncio`, a bare `asyncio.Protocol` that reads the head's `Content-Length`, parses
the body's JSON and writes a serialised reply; `http`, AxRL's `HttpServer` with a minimal ASGI app
doing the same), and the stitching's template work for the same conversations, in process
(`stitch_ms_per_call`: the conversation rendered, and on a continuation the appended messages found
and tokenised).

    OMP_NUM_THREADS=1 python bench/proxy_cpu.py [--rounds 5] [--sessions 32] [--turns 4]

Last stdout line: one JSON object — `proxy_cpu_ms_per_call` (quiet, AxRL's server, median over
rounds), `proxy_cpu_ms_per_call_loaded`, `uvicorn_cpu_ms_per_call` / `_loaded`,
`cpu_ratio_vs_uvicorn` (quiet, paired per round), `asyncio_floor_cpu_ms_per_call`,
`http_floor_cpu_ms_per_call`, `stitch_cpu_ms_per_call` (each also `_loaded`), `load_average_1m_quiet` / `_loaded`,
`cpu_count`, and whether every session recorded one chain of `--turns` turns (`recorded_ok`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time

from axrl.agents.proxy import ProxyServer, SessionPolicy
from axrl.agents.proxy.stitch import appended_text, render
from axrl.inference.protocol import GenerateRequest, GenerateResult, SamplingParams
from axrl.tokenizer import Tokenizer

# The agents' system prompt, first question and the tool answer that follows every reply.
AGENT_MESSAGES = json.dumps([{"role": "system", "content": "You are a helpful assistant. Use the calculator."},
                             {"role": "user", "content": "What is 37 + 58? Think step by step."},
                             {"role": "user", "content": "calculator: 46. Go on."}])
AGENT = r"""
import http.client, json, sys
port, specs, turns = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
system, user, follow = json.loads(sys.argv[4])
for sid, key in specs:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    msgs = [system, user]
    for _ in range(turns):
        conn.request("POST", f"/sessions/{sid}/v1/chat/completions",
                     json.dumps({"model": "policy", "messages": msgs, "max_tokens": 48}),
                     {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        msgs += [reply["choices"][0]["message"], follow]
    conn.close()
"""


class InstantEngine:
    """Answers every request at once with the same reply (ids ending in the turn's end)."""

    def __init__(self, reply: list[int]) -> None:
        self.reply = reply

    def __call__(self, request: GenerateRequest) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(GenerateResult(rid=request.rid, output_ids=list(self.reply),
                                      output_logprobs=[-0.5] * len(self.reply), routed_experts=None,
                                      finish_reason={"type": "stop", "matched": self.reply[-1]},
                                      weight_version=0, output_weight_versions=[0] * len(self.reply),
                                      prompt_tokens=len(request.input_ids)))
        return fut


def uvicorn_proxy(tok: Tokenizer) -> ProxyServer:
    """A ProxyServer whose HTTP is served by uvicorn's h11 protocol (the server before)."""
    import socket

    import uvicorn

    from axrl.agents.proxy.call_routes import CallRoutes
    from axrl.agents.proxy.proxy_app import create_app
    from axrl.inference.openai.http import OneSendH11Protocol

    proxy = ProxyServer(tok, model_name="policy")
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    proxy.port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(CallRoutes(create_app(proxy.registry), proxy.registry),
                                           log_level="warning", access_log=False, lifespan="off",
                                           http=OneSendH11Protocol))
    proxy._thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    proxy._thread.start()
    while not server.started:
        time.sleep(0.01)
    proxy._server = server  # type: ignore[assignment]
    return proxy


FLOORS = ("asyncio", "http")  # FloorServer kinds


class _FloorProtocol(asyncio.Protocol):
    """The least a Python asyncio HTTP server does for one keep-alive JSON call: find the head's
    end and its Content-Length, wait for the body, parse its JSON, serialise a reply, one write."""

    def __init__(self, reply: dict) -> None:
        self.reply, self.buffer, self.transport = reply, bytearray(), None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        at = self.buffer.find(b"Content-Length: ", 0, end)
        length = int(self.buffer[at + 16:self.buffer.find(b"\r\n", at)]) if at >= 0 else 0
        if len(self.buffer) < end + 4 + length:
            return
        json.loads(bytes(self.buffer[end + 4:end + 4 + length]))
        del self.buffer[:end + 4 + length]
        body = json.dumps(self.reply).encode()
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))


def _floor_app(reply: dict):
    """An ASGI app that parses the request's JSON and answers `reply`: AxRL's HTTP server with no
    proxy behind it."""

    async def app(scope, receive, send) -> None:
        json.loads((await receive())["body"])
        body = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    return app


class FloorServer:
    """A server that answers every chat call with the same reply, on a thread of its own whose CPU
    clock is read as `ProxyServer.cpu_seconds()` reads the proxy's: `asyncio` (a bare
    `asyncio.Protocol`, `_FloorProtocol`) or `http` (AxRL's `HttpServer` and a minimal ASGI app)."""

    def __init__(self, kind: str, reply: dict) -> None:
        import socket

        from axrl.agents.proxy.http_server import HttpServer

        sock = socket.socket()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._stop = threading.Event()
        started = threading.Event()

        async def serve() -> None:
            if kind == "http":
                server = HttpServer(_floor_app(reply))
                task = asyncio.ensure_future(server.serve(sock))
                while not server.started:
                    await asyncio.sleep(0.01)
            else:
                sock.listen(1024)
                server = await asyncio.get_running_loop().create_server(lambda: _FloorProtocol(reply), sock=sock)
            started.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
            if kind == "http":
                server.stop()
                await task
            else:
                server.close()

        self._thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        self._thread.start()
        started.wait(30)

    def cpu_seconds(self) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def agents_cpu_ms(server: ProxyServer | FloorServer, specs: list[list[str]], turns: int) -> float:
    """Run the agents (one session per (id, key) of `specs`, `turns` calls each) against `server`:
    its thread's CPU ms per call."""
    c0 = server.cpu_seconds()
    subprocess.run([sys.executable, "-c", AGENT, str(server.port), json.dumps(specs), str(turns), AGENT_MESSAGES],
                   check=True)
    return 1e3 * (server.cpu_seconds() - c0) / (len(specs) * turns)


def floor_round(server: FloorServer, sessions: int, turns: int) -> float:
    """CPU ms per call of a floor server over the agents' calls (their sessions are names only)."""
    return agents_cpu_ms(server, [[f"s{k}", "key"] for k in range(sessions)], turns)


def canned_reply(text: str) -> dict:
    """A chat completion shaped as the proxy's (the floor servers serialise it per call)."""
    return {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion", "created": 1765000000, "model": "policy",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": None},
                         "finish_reason": "stop", "matched_stop": None, "logprobs": None}],
            "usage": {"prompt_tokens": 60, "completion_tokens": 32, "total_tokens": 92}}


def stitch_ms_per_call(tok: Tokenizer, reply_text: str, turns: int, reps: int = 200) -> float:
    """The template work one call of the agents' conversations needs, in process (thread CPU): the
    whole conversation rendered, and on a continuation the appended messages found
    (`stitch.appended_text`: one more render) and tokenised — what stitching costs at the least."""
    system, user, follow = json.loads(AGENT_MESSAGES)
    convs, msgs = [], [system, user]
    for _ in range(turns):
        convs.append(list(msgs))
        msgs = msgs + [{"role": "assistant", "content": reply_text}, follow]
    t0 = time.thread_time()
    for _ in range(reps):
        for k, conv in enumerate(convs):
            full = render(tok, conv, None, generation=True)
            tok.encode(appended_text(tok, conv, len(conv) - 1, None, full) if k else full)
    return 1e3 * (time.thread_time() - t0) / (reps * len(convs))


def one_round(proxy: ProxyServer, engine: InstantEngine, sessions: int, turns: int) -> tuple[float, bool]:
    """(proxy CPU ms per call, every session recorded one chain of `turns` turns)."""
    policy = SessionPolicy(sampling=SamplingParams(max_new_tokens=48), max_tokens=48)
    opened = [proxy.open_session(engine, policy, max_context_len=4096) for _ in range(sessions)]
    ms = agents_cpu_ms(proxy, [[s.id, s.api_key] for s in opened], turns)
    ok = all([t.parent for t in s.turns.values()] == [None, *range(1, turns)] for s in opened)
    for s in opened:
        proxy.close_session(s)
    return ms, ok


def _spin(stop: multiprocessing.Event) -> None:
    while not stop.is_set():
        sum(range(10_000))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 1, help="spinning processes when loaded")
    args = ap.parse_args()
    tok = Tokenizer.default()
    engine = InstantEngine(tok.encode("Sure: 37 plus 58 is 95, so the answer is 95.")[:31] + tok.stop_token_ids[:1])
    servers = {"axrl": ProxyServer(tok, model_name="policy").start(), "uvicorn": uvicorn_proxy(tok)}
    reply_text = tok.decode(engine.reply[:-1])
    floors = {name: FloorServer(name, canned_reply(reply_text)) for name in FLOORS}
    out: dict[str, object] = {}
    ok = True
    for name, proxy in servers.items():  # warm both (imports, template compilation)
        one_round(proxy, engine, 4, args.turns)
    for condition in ("quiet", "loaded"):
        stop = multiprocessing.Event()
        burners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                   for _ in range(args.burners if condition == "loaded" else 0)]
        for p in burners:
            p.start()
        time.sleep(1.0 if burners else 0.0)
        load = os.getloadavg()[0]
        per: dict[str, list[float]] = {n: [] for n in (*servers, *floors)}
        for _ in range(args.rounds):
            for name, proxy in servers.items():
                ms, good = one_round(proxy, engine, args.sessions, args.turns)
                per[name].append(ms)
                ok &= good
            for name, floor in floors.items():
                per[name].append(floor_round(floor, args.sessions, args.turns))
        stop.set()
        for p in burners:
            p.join()
        suffix = "" if condition == "quiet" else "_loaded"
        out[f"proxy_cpu_ms_per_call{suffix}"] = statistics.median(per["axrl"])
        out[f"uvicorn_cpu_ms_per_call{suffix}"] = statistics.median(per["uvicorn"])
        out[f"cpu_ratio_vs_uvicorn{suffix}"] = statistics.median(a / b for a, b in zip(per["axrl"], per["uvicorn"]))
        for name in floors:
            out[f"{name}_floor_cpu_ms_per_call{suffix}"] = statistics.median(per[name])
        out[f"stitch_cpu_ms_per_call{suffix}"] = stitch_ms_per_call(tok, reply_text, args.turns)
        out[f"load_average_1m_{condition}"] = load
        print(f"{condition} (load {load:.2f}): CPU per call, ms — "
              + "; ".join(f"{n} {[round(x, 3) for x in v]}" for n, v in per.items()), flush=True)
    for proxy in servers.values():
        if proxy is servers["uvicorn"]:
            proxy._server.should_exit = True  # type: ignore[union-attr]
        else:
            proxy.stop()
    for floor in floors.values():
        floor.stop()
    out.update(cpu_count=os.cpu_count(), recorded_ok=ok, sessions=args.sessions, turns=args.turns)
    print(json.dumps(out))
    if not ok:
        sys.exit("a session did not record one chain of its turns")


if __name__ == "__main__":
    main()
