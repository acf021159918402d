"""kvtc-server from Python, over its real HTTP API (requests): start one on
a free loopback port, wait until it is healthy, talk to it, read its
Prometheus metrics, stop it; redis-server the same way. Used by
tests/test_server*.py, bench/serve.py and the Python package's tests."""
import os
import re
import signal
import socket
import subprocess
import time

try:
    import requests
except ImportError:  # the Python package's venv has none: it uses the Redis helper only
    requests = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One kvtc-server process. `args` are its flags beyond the model, host
    and port; its log (stdout and stderr) goes to `log_path`."""

    def __init__(self, binary, model, args, log_path, ctx=8192, env=None, preexec_fn=None, port=None):
        if requests is None:
            raise RuntimeError("serverlib.Server talks HTTP with requests (Debian's python3-requests), which this Python lacks")
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

    def wait_scanned(self, timeout=300):
        """Waits until the disk tier has verified every entry file found at start (read back in the background); returns the metrics."""
        t0 = time.time()
        while True:
            m = self.metrics()
            if m.get("kvtc:disk_scan_pending", 0) == 0:
                return m
            if time.time() - t0 > timeout:
                raise TimeoutError("disk entries still being verified")
            time.sleep(0.2)

    def stream_while_prompting(self, tag, max_tokens=80):
        """Streams a greedy reply of max_tokens tokens (ignore_eos) while
        sending, one after another until it ends, short /completion prompts
        that share no first token with the one before (llama-server then
        gives each the other slot by LRU and asks its prompt cache: with a
        Redis tier, a lookup that reaches Redis). Needs --parallel 2.
        Returns (arrival times of the streamed tokens, the stream's errors,
        each prompt's HTTP status or None when the request failed)."""
        import threading

        body = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "ignore_eos": True}
        arrivals, errors, statuses = [], [], []

        def stream():
            try:
                with requests.post(self.url + "/v1/chat/completions", json=body, stream=True, timeout=120) as q:
                    q.raise_for_status()
                    for line in q.iter_lines():
                        if line.startswith(b"data: ") and b'"content"' in line:
                            arrivals.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - returned
                errors.append(repr(e))

        t = threading.Thread(target=stream)
        t.start()
        while not arrivals and t.is_alive():
            time.sleep(0.01)
        while t.is_alive():
            word = ("Rivers", "Clouds", "Mountains", "Lanterns", "Violins", "Orchards")[len(statuses) % 6]
            try:
                q = requests.post(self.url + "/completion",
                                  json={"prompt": f"{word} {tag} {len(statuses)} are", "n_predict": 2, "temperature": 0}, timeout=60)
                statuses.append(q.status_code)
            except requests.RequestException:
                statuses.append(None)
        t.join()
        return arrivals, errors, statuses

    def rss_kib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read())[1])


def add_server_args(ap):
    """The arguments every kvtc-server benchmark takes (bench/*.sh passes
    them): the server binary, the model, the calibration, the corpus."""
    for name in ("--server", "--model", "--calib", "--corpus"):
        ap.add_argument(name, required=True)


class Redis:
    """One redis-server on a loopback port (Debian's, installed by the
    bootstrap), without persistence, in `workdir`; `extra` are its flags
    (e.g. ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"])."""

    def __init__(self, workdir, extra=(), port=None, password=None):
        self.port = port or free_port()
        self.dir = workdir
        self.password = password  # with --requirepass in extra: redis-cli authenticates
        self.extra = list(extra)
        os.makedirs(workdir, exist_ok=True)
        self.proc = None
        self.start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    @property
    def hostport(self):
        return f"127.0.0.1:{self.port}"

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                      "--dir", self.dir, "--logfile", os.path.join(self.dir, "redis.log"), *self.extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while time.time() - t0 < 10:
            if self.cli("PING", check=False).strip() in ("PONG", "NOAUTH Authentication required."):
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on {self.port} did not answer; see {self.dir}/redis.log")

    def cli(self, *args, check=True):
        """redis-cli's output for one command (raw mode)."""
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        r = subprocess.run(["redis-cli", "-p", str(self.port), *auth, "--raw", *map(str, args)], capture_output=True, text=True,
                           errors="replace", timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"redis-cli {args}: {r.stderr}")
        return r.stdout

    def info(self, section):
        """{field: value} of INFO <section>."""
        out = {}
        for line in self.cli("INFO", section).splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                out[k] = v.strip()
        return out

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def free_cluster_port():
    """A free port whose cluster bus port (+10000) is free as well."""
    while True:
        p = free_port()
        if p > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                continue


class RedisCluster:
    """Three masters made into a Redis Cluster by `redis-cli --cluster create`."""

    def __init__(self, workdir):
        self.nodes = [Redis(os.path.join(workdir, f"node{i}"), ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                                                 "--cluster-node-timeout", "5000"], port=free_cluster_port())
                      for i in range(3)]
        r = subprocess.run(["redis-cli", "--cluster", "create", *[n.hostport for n in self.nodes], "--cluster-replicas", "0",
                            "--cluster-yes"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError("redis-cli --cluster create: " + r.stdout + r.stderr)
        t0 = time.time()
        while not all("cluster_state:ok" in n.cli("CLUSTER", "INFO") for n in self.nodes):
            if time.time() - t0 > 20:
                raise TimeoutError("the redis cluster did not come up")
            time.sleep(0.05)

    @property
    def seeds(self):
        return ",".join(n.hostport for n in self.nodes)

    def stop(self):
        for n in self.nodes:
            n.stop()


class TrickleProxy:
    """A TCP proxy on a loopback port in front of `port` (a Redis), for
    fault tests: mode "pass" forwards bytes as they come; "trickle" passes
    what the server sends back one byte every `delay` seconds (a link or a
    server that answers, but too slowly: a per-call socket timeout never
    fires on it, only a deadline for the whole exchange does). What the
    client sends always goes through at once. Threads, one pair per
    connection; stop() closes everything."""

    def __init__(self, port, delay=0.05):
        import threading

        self.upstream = port
        self.delay = delay
        self.mode = "pass"
        self._threading = threading
        self._socks = []
        self._lock = threading.Lock()
        self._stopped = False
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(64)
        self.port = self._srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}"

    def _accept(self):
        while not self._stopped:
            try:
                c, _ = self._srv.accept()
                u = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
                u.settimeout(None)
            except OSError:
                if self._stopped:
                    return
                continue
            with self._lock:
                self._socks += [c, u]
            self._threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            self._threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, back):
        try:
            while True:
                b = src.recv(65536)
                if not b:
                    break
                if back and self.mode == "trickle":
                    for i in range(len(b)):
                        time.sleep(self.delay)
                        dst.sendall(b[i:i + 1])
                else:
                    dst.sendall(b)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self):
        self._stopped = True
        self._srv.close()
        with self._lock:
            for s in self._socks:
                try:
                    s.close()
                except OSError:
                    pass
