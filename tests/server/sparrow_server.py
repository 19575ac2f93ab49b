"""Running `sparrow serve` from the tests, and reading its /metrics."""
from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL_NAME = "test-model"
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60


class SparrowServer:
    """One `sparrow serve` process."""

    def __init__(self, binary: str, model_dir: Path, *flags: str, log_requests: bool = False):
        quiet = [] if log_requests else ["--disable-log-requests"]
        self.command = [binary, "serve", str(model_dir), "--host", "127.0.0.1", "--port", "0",
                        "--served-model-name", MODEL_NAME, *quiet, *flags]
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        ready = threading.Event()
        self.port = None

        def read_stdout():
            for line in self.process.stdout:
                self.stdout.append(line)
                match = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
                if match:
                    self.port = int(match.group(1))
                    ready.set()
            ready.set()  # the process ended

        def read_stderr():
            for line in self.process.stderr:
                self.stderr.append(line)

        threading.Thread(target=read_stdout, daemon=True).start()
        threading.Thread(target=read_stderr, daemon=True).start()
        if not ready.wait(START_TIMEOUT_S) or self.port is None:
            self.process.kill()
            raise RuntimeError(f"sparrow serve did not start: {' '.join(self.command)}\n{self.output()}")
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return "".join(self.stdout) + "".join(self.stderr)

    def client(self, **kwargs):
        import openai
        kwargs.setdefault("api_key", API_KEY)
        kwargs.setdefault("max_retries", 0)  # the tests look at every status themselves
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url + "/v1", **kwargs)

    def stop(self) -> int:
        """SIGTERM, as a process manager would: the server drains and exits. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise RuntimeError("sparrow serve did not exit after SIGTERM\n" + self.output())
        return self.process.returncode

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{labels}": value} (model_name label dropped: one model per server)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")
                out[key] = float(value)
        return out


def wait_until(condition, timeout_s: float = 20, interval_s: float = 0.05):
    """Polls `condition` until it returns something true; returns it, or the last value on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)
