"""The agents' side of bench/proxy_overhead.py: a process of its own (as agents run in training,
never in the engine's process), reading one job a line on stdin and printing one JSON report a
line: the calls of every agent at once, over HTTP (`http.client`) or the official `openai` SDK.

    python bench/proxy_agents.py < jobs.jsonl      # started by bench/proxy_overhead.py
"""

from __future__ import annotations

import http.client
import importlib
import json
import os
import select
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


def sdk_client(call: dict) -> Any:
    """The official client for one agent's session (no retries: every call must answer)."""
    import openai  # here, not at the top: the burner process (`burner_main`) needs none of it

    return openai.OpenAI(base_url=call["base_url"], api_key=call["api_key"], max_retries=0)


def stream_call(call: dict, max_tokens: int) -> dict[str, float]:
    """One streamed chat call over HTTP: seconds to its first content chunk and to its end."""
    url = urllib.parse.urlsplit(call["base_url"])
    conn = http.client.HTTPConnection(url.hostname, url.port)
    headers = {"Authorization": f"Bearer {call['api_key']}", "Content-Type": "application/json"}
    conn.request("GET", f"{url.path}/models", headers=headers)  # connection set-up outside the timing
    conn.getresponse().read()
    body = json.dumps({"model": "policy", "messages": call["messages"], "max_tokens": max_tokens, "stream": True})
    t0, first = time.perf_counter(), None
    conn.request("POST", f"{url.path}/chat/completions", body, headers)
    for line in conn.getresponse():  # SSE lines as they arrive
        if first is None and line.startswith(b"data: {") and b'"content": "' in line and b'"content": ""' not in line:
            first = time.perf_counter()
    end = time.perf_counter()
    conn.close()
    return {"ttft_s": (first or end) - t0, "completion_s": end - t0}


def sdk_agent_processes(calls: list[dict], max_tokens: int) -> dict:
    """Every call from an agent process of its own, all at once: each child (forked from this
    process, `openai` imported, as `axrl.agents.forkserver` starts `python agent.py` episodes)
    builds its client and connects, then all start their call on one signal (the parent closing a
    pipe); seconds from the signal to the last child's reply parsed."""
    importlib.import_module("openai")  # in the parent, before the forks, as the fork server has it

    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pids = []
    for c in calls:
        pid = os.fork()
        if pid == 0:  # the agent
            code = 0
            try:
                os.close(go_w)
                client = sdk_client(c)
                client.models.list()  # connection set-up outside the timing (an agent keeps its client)
                os.write(res_w, b"r")
                os.read(go_r, 1)  # returns on the parent's close: every agent starts at once
                cpu = time.process_time()
                r = client.chat.completions.create(model="policy", messages=c["messages"], max_tokens=max_tokens)
                end, cpu = time.perf_counter(), time.process_time() - cpu
                os.write(res_w, json.dumps({"end": end, "cpu": cpu, "tokens": r.usage.completion_tokens}).encode() + b"\n")
            except BaseException as e:  # noqa: BLE001 — reported to the parent, never a second bench
                os.write(res_w, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()[:4000] + b"\n")
                code = 1
            os._exit(code)
        pids.append(pid)
    os.close(go_r)
    os.close(res_w)
    reader = os.fdopen(res_r, "rb")
    for _ in calls:  # every agent connected
        if reader.read(1) != b"r":
            raise RuntimeError(f"an SDK agent failed before its call: {reader.readline()!r}")
    t0 = time.perf_counter()
    os.close(go_w)
    done = [json.loads(reader.readline()) for _ in calls]
    reader.close()
    for pid in pids:
        os.waitpid(pid, 0)
    errors = [d["error"] for d in done if "error" in d]
    if errors:
        raise RuntimeError(f"SDK agents failed: {errors}")
    # perf_counter is CLOCK_MONOTONIC: one clock for every process of the machine
    return {"seconds": max(d["end"] for d in done) - t0, "tokens": sum(d["tokens"] for d in done), "t0": t0,
            "ends": [d["end"] for d in done], "cpu_s": sum(d["cpu"] for d in done)}


def http_agent(call: dict) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """An HTTP agent's connection to its session (set up outside the timing, as an agent keeps
    its connection across turns), the chat path and the headers."""
    url = urllib.parse.urlsplit(call["base_url"])
    conn = http.client.HTTPConnection(url.hostname, url.port)
    headers = {"Authorization": f"Bearer {call['api_key']}", "Content-Type": "application/json"}
    conn.request("GET", f"{url.path}/models", headers=headers)
    conn.getresponse().read()
    return conn, f"{url.path}/chat/completions", headers


def agent_sessions(job: dict) -> dict:
    """Multi-turn agent sessions, one thread each, all started at once: session i makes
    `len(lengths[i])` chat calls back to back (call t with `max_tokens` lengths[i][t]), appending
    the assistant's reply and then `follow_up` (the tool's answer) to its conversation before the
    next call. mode "http-turns" posts the JSON with `http.client`; "sdk-turns" calls the official
    client (one per agent, built and connected before the timing)."""
    calls, sdk, lengths, follow_up = job["calls"], job["mode"] == "sdk-turns", job["lengths"], job["follow_up"]
    if sdk:
        agents = [sdk_client(c) for c in calls]
        for a in agents:  # connection set-up outside the timing
            a.models.list()
    else:
        agents = [http_agent(c) for c in calls]
    ends, cpu = [0.0] * len(calls), [0.0] * len(calls)

    def turn(i: int, messages: list[dict], max_tokens: int) -> tuple[dict, int]:
        """One chat call: the assistant message to append and the tokens generated."""
        if sdk:
            r = agents[i].chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
            reply = r.choices[0].message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            return reply, r.usage.completion_tokens
        conn, path, headers = agents[i]
        conn.request("POST", path, json.dumps({"model": "policy", "messages": messages, "max_tokens": max_tokens}),
                     headers)
        r = json.loads(conn.getresponse().read())
        reply = {k: v for k, v in r["choices"][0]["message"].items() if k in ("role", "content", "tool_calls")}
        return reply, r["usage"]["completion_tokens"]

    def session(i: int) -> int:
        c0, tokens, messages = time.thread_time(), 0, list(calls[i]["messages"])
        for max_tokens in lengths[i]:
            reply, n = turn(i, messages, max_tokens)
            tokens += n
            messages += [reply, follow_up]
        ends[i], cpu[i] = time.perf_counter(), time.thread_time() - c0
        return tokens

    with ThreadPoolExecutor(len(calls)) as pool:
        list(pool.map(lambda i: None, range(len(calls))))  # start the threads outside the timing
        t0 = time.perf_counter()
        tokens = sum(pool.map(session, range(len(calls))))
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": tokens, "t0": t0, "ends": ends, "cpu_s": sum(cpu),
            "calls": sum(map(len, lengths))}


def client_main() -> None:
    """The agents' process: per job line, every call at once.

    mode "sdk": the official `openai` client, one client and thread per call in this process
    (agents sharing a GIL); "sdk-processes": the same client, one agent process per call (as AxRL
    runs a command agent: `sdk_agent_processes`); "http": the same JSON bodies, built before the timing and
    posted with `http.client` from one thread each — what the proxy itself costs, without the
    SDK's request building and response parsing (the agent's own CPU, on the same cores)."""
    for line in sys.stdin:
        job = json.loads(line)
        if job["mode"] in ("http-turns", "sdk-turns"):
            print(json.dumps(agent_sessions(job)), flush=True)
            continue
        if job["mode"] == "stream":
            print(json.dumps(stream_call(job["calls"][0], job["max_tokens"])), flush=True)
            continue
        if job["mode"] == "sdk-processes":
            print(json.dumps(sdk_agent_processes(job["calls"], job["max_tokens"])), flush=True)
            continue
        calls, sdk = job["calls"], job["mode"] == "sdk"
        if sdk:
            clients = [sdk_client(c) for c in calls]
            for c in clients:  # connection set-up outside the timing (an agent keeps its client)
                c.models.list()
        else:
            conns, posts = [], []
            for c in calls:
                conn, path, headers = http_agent(c)
                conns.append(conn)
                posts.append((path, json.dumps({"model": "policy", "messages": c["messages"],
                                                "max_tokens": job["max_tokens"]}), headers))

        ends, cpu = [0.0] * len(calls), [0.0] * len(calls)

        def call(i: int) -> int:
            c0 = time.thread_time()
            try:
                return call_once(i)
            finally:
                ends[i], cpu[i] = time.perf_counter(), time.thread_time() - c0

        def call_once(i: int) -> int:
            if sdk:
                r = clients[i].chat.completions.create(model="policy", messages=calls[i]["messages"],
                                                       max_tokens=job["max_tokens"])
                return r.usage.completion_tokens
            conns[i].request("POST", *posts[i])
            return json.loads(conns[i].getresponse().read())["usage"]["completion_tokens"]

        with ThreadPoolExecutor(len(calls)) as pool:
            list(pool.map(lambda i: None, range(len(calls))))  # start the threads outside the timing
            t0 = time.perf_counter()
            tokens = sum(pool.map(call, range(len(calls))))
            seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "tokens": tokens, "t0": t0, "ends": ends, "cpu_s": sum(cpu)}),
              flush=True)


def burn(burst_s: float, period_s: float, stopped: Callable[[float], bool]) -> None:
    """Spend `burst_s` of this thread's CPU in Python every `period_s` until `stopped(timeout)`
    (which waits up to `timeout` seconds) says so."""
    while True:
        t, cpu = time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu < burst_s:
            sum(i * i for i in range(100))
        if stopped(max(period_s - (time.perf_counter() - t), 0.0)):
            return


def burner_main(burst_s: float, period_s: float) -> None:
    """`burn` in a process of its own: CPU without the GIL of the engine's
    process, until stdin closes."""
    print("burning", flush=True)
    burn(burst_s, period_s, lambda timeout: bool(select.select([sys.stdin], [], [], timeout)[0]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--burn"]:
        burner_main(float(sys.argv[2]), float(sys.argv[3]))
    else:
        client_main()
