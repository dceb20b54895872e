"""`smc-sd serve` in a subprocess on a free loopback port (`--port 0`), for the server tests
(tests/test_serve.py, tests/vllm/test_vllm_serve.py); each test stops the server it started by
its own process handle."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import openai

MODEL = "SmolLM2-135M-Instruct"
SERVE = [sys.executable, "-m", "smc_sd.cli", "serve", "--port", "0"]
#: seconds a server may take to start (the first run converts the default model, about 35 s)
START_SECONDS = 300


class ServerProcess:
    """`smc-sd serve` in a subprocess; `url` is its API base, `stderr` the lines it wrote.

    `dtype` is float32 on every processor: the tests ask one seed for the same answer twice, and
    in bfloat16 (`--dtype auto` where the processor has AMX) the round-off between a prompt
    computed fresh and its KV read from the prefix cache moves the sample a seed names
    (docs/batching.md). None passes no --dtype (llama.cpp runs the GGUF's own weight format).
    """

    def __init__(self, *flags: str, dtype: str | None = "float32"):
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        precision = ["--dtype", dtype] if dtype else []
        self.process = subprocess.Popen([*SERVE, *precision, *flags], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, env=env)
        self.stderr: list[str] = []
        ready = threading.Event()
        self.url = None

        def read():
            for line in self.process.stderr:
                self.stderr.append(line.rstrip("\n"))
                found = re.search(r" on (http://\S+/v1)$", line.strip())
                if found and self.url is None:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(START_SECONDS) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "\n".join(self.stderr[-20:]))

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=300)

    def get(self, path: str) -> tuple[int, str]:
        """(status, body) of GET `path` (e.g. "/metrics") on the server's root."""
        return http(self.url.removesuffix("/v1") + path)

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}

    def stop(self) -> None:
        """Stop this server's process (SIGTERM, then SIGKILL after 30 s)."""
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)


def http(url: str, body: bytes | None = None) -> tuple[int, str]:
    """(status, body text) of a GET, or of a POST of `body` as application/json."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
