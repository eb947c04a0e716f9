"""Several `vllm serve` replicas behind vLLM's router: test infrastructure of test_scale_out.py (docs/scale_out.md).

A replica (`Engine`) is the `vllm serve` command scripts/compile_and_save.py --for-vllm printed, as each trn2 box
runs it, plus what only this CPU test adds (a local port, the tiny checkpoint's HF tokenizer, NxD's CPU mode). It
runs in its own process group, as a box: kill() ends the group with SIGKILL, as a box that loses power, and start()
brings it back on the same port, as a box that reboots. The router (`Router`) is vllm-router from PyPI, which
scripts/build_nxdi_cpu_tier.sh installs into the tier venv; nothing of it is ours.

Which replica served a request is read from the replicas themselves (vLLM's /metrics counters), not from the router.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROUTER_VERSION = "0.1.17"
# the command's head in compile_and_save.py --for-vllm's output
PRINTED = "serve it with vLLM (docs/vllm.md):\n"
TIMEOUT = httpx.Timeout(180.0, connect=10.0)


def wait_for(what: str, check, timeout: float, every: float = 0.2):
    """check()'s first truthy value within `timeout` s, else AssertionError naming `what`: tests wait for states,
    never for a fixed time."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


def printed_serve_command(stdout: str) -> tuple[dict, list[str]]:
    """(environment, arguments after `vllm serve`) of the command compile_and_save.py --for-vllm printed."""
    text = stdout.split(PRINTED, 1)[1].split("\n\n", 1)[0]
    words = shlex.split(text.replace("\\\n", " "))
    env = {}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[:2] == ["vllm", "serve"], words[:3]
    return env, words[2:]


def flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def _end_group(proc: subprocess.Popen, family: list[psutil.Process], sig: int = signal.SIGTERM,
               wait: float = 60) -> None:
    """End `proc`, which leads its own process group (start_new_session), and `family`, the processes it had
    started (vLLM's engine core): the group is signalled only while its leader lives (its id is ours then), and
    whatever of `family` outlived it is killed by identity (psutil checks the start time), so that nothing else is."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    for p in family:
        try:
            if p.is_running():
                p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)


class Engine:
    """One replica: `vllm serve ARGS` on 127.0.0.1:port, its own process group, its log appended to `log`."""

    def __init__(self, name: str, args: list[str], env: dict, port: int, log: Path):
        self.name, self.args, self.env, self.port, self.log = name, args, env, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.family: list[psutil.Process] = []  # what the server started (the engine core), once it is ready
        self.up = False  # answered since it was last started (the tests count requests on up replicas only)

    def start(self) -> None:
        self.up, self.family = False, []
        cmd = [str(Path(sys.executable).parent / "vllm"), "serve", *self.args, "--host", "127.0.0.1", "--port",
               str(self.port)]
        with open(self.log, "a") as log:
            log.write(f"\n--- {' '.join(cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name}: vllm serve exited {self.proc.returncode}: {self.tail()}")
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout: float = 400) -> None:
        try:
            wait_for(f"{self.name}: vllm serve ready on {self.url}", self.ready, timeout, every=1)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tail()}") from None
        self.family = psutil.Process(self.proc.pid).children(recursive=True)
        self.up = True

    def kill(self) -> None:
        """The box loses power: SIGKILL to the API server and the engine core at once."""
        self.up = False
        _end_group(self.proc, self.family, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None:
            _end_group(self.proc, self.family)

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""

    def counters(self) -> dict[str, float]:
        """vLLM's Prometheus counters and gauges of this replica that the tests read."""
        text = httpx.get(self.url + "/metrics", timeout=10).text

        def total(name):
            return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE))
        return {"finished": total("vllm:request_success_total"), "running": total("vllm:num_requests_running")}


def finished(engines: list[Engine]) -> dict[str, float]:
    """Requests each up replica has finished (any reason, aborts included)."""
    return {e.name: e.counters()["finished"] for e in engines if e.up}


def served_by(engines: list[Engine], before: dict[str, float]) -> str:
    """The one replica that finished one more request than in `before` (waited for: vLLM counts a request as its
    output loop records it, which may come just after the reply)."""
    def one():
        delta = {name: n - before[name] for name, n in finished(engines).items()}
        assert sum(delta.values()) <= 1, f"more than one request finished: {delta}"
        return next((name for name, d in delta.items() if d == 1), None)
    return wait_for("a replica's finished-requests counter to move", one, 30)


class Router:
    """vllm-router (the Rust router's Python launcher) over `workers`, on free local ports, its log in `log`."""

    def __init__(self, workers: list[str], args: list[str], log: Path):
        from kimi_k2_neuron.runtime.ranks import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1", "--port",
                    str(self.port), "--worker-urls", *workers, "--prometheus-host", "127.0.0.1", "--prometheus-port",
                    str(free_port()), *args]
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self) -> dict[str, bool]:
        """worker URL -> healthy, as the router's health checker last judged it."""
        reply = httpx.get(self.url + "/workers", timeout=10).json()
        return {w["url"]: w["is_healthy"] for w in reply["workers"]}

    def wait_workers(self, want: dict[str, bool], timeout: float = 60) -> None:
        def seen():
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm-router exited {self.proc.returncode}: {self.tail()}")
            try:
                return all(self.workers().get(url) == healthy for url, healthy in want.items())
            except httpx.HTTPError:
                return False
        wait_for(f"the router to see {want}", seen, timeout)

    def stop(self) -> None:
        _end_group(self.proc, [])

    def tail(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else ""


# -- the client ------------------------------------------------------------------------------------------------------

def chat(base: str, body: dict, session: str | None = None) -> dict:
    """POST /v1/chat/completions (not streamed) as a Kimi agent does: its session key both as Kimi's
    `prompt_cache_key` and as the X-Session-ID header, which is what vllm-router reads (docs/scale_out.md)."""
    body, headers = with_session(body, session)
    reply = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert reply.status_code == 200, (reply.status_code, reply.text[:2000])
    return reply.json()


def with_session(body: dict, session: str | None) -> tuple[dict, dict]:
    if session is None:
        return body, {}
    return {**body, "prompt_cache_key": session}, {"X-Session-ID": session}


class Stream:
    """A streamed chat completion read chunk by chunk (in a thread of its own): its token ids, whether `[DONE]`
    came, and the exception that ended it otherwise."""

    def __init__(self, base: str, body: dict, session: str | None = None):
        self.body, self.headers = with_session({**body, "stream": True}, session)
        self.url = base + "/v1/chat/completions"
        self.tokens: list[int] = []
        self.chunks = 0
        self.done = False
        self.status: int | None = None
        self.error: BaseException | None = None

    def __call__(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers, timeout=TIMEOUT) as reply:
                self.status = reply.status_code
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    for choice in json.loads(line[6:]).get("choices") or ():
                        self.tokens += choice.get("token_ids") or []
                    self.chunks += 1
        except Exception as e:  # noqa: BLE001 -- the test reads how the stream ended
            self.error = e
