"""kvtc-server from Python, over its real HTTP API (requests): start one on
a free loopback port, wait until it is healthy, talk to it, read its
Prometheus metrics, stop it. Used by tests/test_server.py and
bench/serve.py."""
import os
import re
import signal
import socket
import subprocess
import time

import requests


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One kvtc-server process. `args` are its flags beyond the model, host
    and port; its log (stdout and stderr) goes to `log_path`."""

    def __init__(self, binary, model, args, log_path, ctx=8192, env=None, preexec_fn=None, port=None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(ctx), "--metrics", "--slots",
                    "--no-webui", *args]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn)

    def wait_ready(self, timeout=120):
        """True once /health answers 200; False if the process exits first."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                return False
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"kvtc-server not ready after {timeout} s; log: {self.log_path}")

    def wait_exit(self, timeout=120):
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def stop(self, timeout=60):
        """SIGTERM (a graceful shutdown: queued saves are stored first), then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def chat(self, messages, max_tokens=8, stream=False, timeout=600, **extra):
        """(reply text, timings, whole response) of a greedy chat completion."""
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 1, **extra}
        r = requests.post(self.url + "/v1/chat/completions", json=body, timeout=timeout)
        r.raise_for_status()
        j = r.json()
        return j["choices"][0]["message"]["content"], j.get("timings", {}), j

    def metrics(self):
        """{name or name{labels}: value} of the Prometheus text at /metrics."""
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"^(\S+?)(\{.*\})?\s+(\S+)$", line)
            if m:
                out[m[1] + (m[2] or "")] = float(m[3])
        return out

    def metric_labels(self, name):
        """The label sets of a metric, e.g. {error="..."} of kvtc:disk_enabled."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        return re.findall(r"^" + re.escape(name) + r"(\{.*\})?\s", text, re.MULTILINE)

    def wait_saved(self, timeout=300):
        """Waits until no save is queued for compression; returns the metrics."""
        t0 = time.time()
        while True:
            m = self.metrics()
            if m.get("kvtc:pending", 0) == 0:
                return m
            if time.time() - t0 > timeout:
                raise TimeoutError("saves still queued")
            time.sleep(0.2)

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])
