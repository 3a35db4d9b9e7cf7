"""`flide serve` as a subprocess of the benchmark: started on a free loopback port, waited for, always stopped.

    with FlideServer(config) as server:          # `python -m flide.cli serve ...` on 127.0.0.1:<free port>
        server.url                               # http://127.0.0.1:<port>; /health answered 200
        server.metrics()                         # {(sample name, labels): value} of its Prometheus /metrics

The server serves the model the grid measures: `--model CONFIG.json --random-weights --tokenizer ...` builds the same
random weights as the benchmark's `random_model(..., seed=0)` on the same device and dtype (a Flide config written for
it sets `runtime.dtype` / `runtime.device`, plus the grid's `flide:` overrides and `http.flide`); `tiny:qwen3_5_text`
is the CLI's embedded tiny model (seed 0). The engine checks its answers against the in-process engine's.

Stopping: SIGINT (uvicorn's graceful shutdown: in-flight requests finish, the model thread stops), then SIGKILL after
30 s. On Linux the server also gets SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG, set by a small
launcher that then execs `flide serve`: start it from the main thread), so a killed benchmark leaves no server holding
the GPU. Its output goes to a log file whose tail is quoted when it fails.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from .config import REPO, TINY_PREFIX, BenchConfig, merge_overrides

if TYPE_CHECKING:
    from typing_extensions import Self

SERVABLE_TINY = "tiny:qwen3_5_text"  # the model `flide serve` embeds (no --model)
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through an http_proxy


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def servable(spec: str, config: BenchConfig) -> str | None:
    """Why `flide serve` cannot serve the grid's model `spec` as the benchmark builds it (None: it can)."""
    if spec.startswith(TINY_PREFIX) and spec != SERVABLE_TINY:
        return f"`flide serve` embeds only {SERVABLE_TINY}; {spec} cannot be served"
    if config.seed != 0:
        return f"`flide serve --random-weights` draws its weights with seed 0; the config's seed is {config.seed}"
    if config.final_norm_scale not in (None, 1.0):
        return "`flide serve` does not scale the final norm (final_norm_scale)"
    return None


# The server is started through this launcher: it asks Linux to SIGKILL it when the benchmark's thread that started it
# ends (prctl PR_SET_PDEATHSIG, kept across exec), exits if that parent is already gone, then execs `flide serve` in
# the same process (same pid). No preexec_fn: nothing runs between fork and exec in a multi-threaded parent.
_LAUNCHER = ("import ctypes, os, signal, sys\n"
             "if sys.platform == 'linux':\n"
             "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))\n"
             "    if os.getppid() != int(sys.argv[1]):\n"
             "        sys.exit('flide bench: the benchmark process is gone')\n"
             "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n")


def serve_command(config_path: Path, port: int, model: str | None = None, tokenizer: str | None = None) -> list[str]:
    """`python -m flide.cli serve` on 127.0.0.1:`port` with the config at `config_path` (JSON request logs), behind
    the launcher that ends the server with this process (`_LAUNCHER`); `model` (a config JSON, drawn with random
    weights) with its `tokenizer`, or the config's own model when None."""
    cmd = [sys.executable, "-c", _LAUNCHER, str(os.getpid()), "-m", "flide.cli", "serve", "--config",
           str(config_path), "--host", "127.0.0.1", "--port", str(port), "--log-format", "json"]
    if model is not None:
        cmd += ["--model", model, "--random-weights", "--tokenizer", str(tokenizer)]
    return cmd


def wait_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout: float,
                 setting: str = "http.startup_timeout_s") -> None:
    """Until the `flide serve` process at `url` answers /health "ok"; raises (with its log's end) when it exits first
    or `timeout` (the config's `setting`) passes."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"flide serve exited with code {process.returncode} before answering "
                               f"/health; its log ({log_path}) ends:\n{log_tail(log_path)}")
        try:
            with _LOCAL.open(f"{url}/health", timeout=5) as response:
                if response.status == 200 and json.loads(response.read()).get("status") == "ok":
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"flide serve did not answer /health within {timeout:g} s "
                               f"({setting}); its log ({log_path}) ends:\n{log_tail(log_path)}")
        time.sleep(0.2)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def prometheus_samples(url: str) -> dict[tuple[str, str], float]:
    """The Prometheus samples of a server's /metrics: {(name, labels text): value}."""
    with _LOCAL.open(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode("utf-8")
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        try:
            samples[(name, labels.rstrip("}"))] = float(value)
        except ValueError:
            continue
    return samples


class FlideServer:
    """A `flide serve` subprocess serving the model `spec` of a benchmark config (see the module docstring)."""

    def __init__(self, spec: str, config: BenchConfig, device: str, log_dir: str | Path | None = None):
        reason = servable(spec, config)
        if reason:
            raise ValueError(f"Engine http: {reason}.")
        self.spec, self.config, self.device = spec, config, device
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="flide_bench_http_"))
        self.folder.mkdir(parents=True, exist_ok=True)
        self.log_path = self.folder / f"server_{self.port}.log"
        self.process: subprocess.Popen | None = None

    def flide_config(self) -> dict:
        """The server's Flide config: the grid's overrides, `http.flide`, and the benchmark's dtype and device."""
        merged = merge_overrides(self.config.flide, self.config.http.flide)
        merged["runtime"] = {**merged.get("runtime", {}), "dtype": self.config.dtype, "device": self.device}
        return merged

    def command(self, config_path: Path) -> list[str]:
        """`python -m flide.cli serve ...` for this server (`serve_command`): the grid's model, or the tiny one that
        the written config embeds."""
        if self.spec.startswith(TINY_PREFIX):
            return serve_command(config_path, self.port)
        return serve_command(config_path, self.port, self.spec, str(self.config.tokenizer))

    def start(self) -> Self:
        import yaml

        config_path = self.folder / f"server_{self.port}.yaml"
        config_path.write_text(yaml.safe_dump(self.flide_config()), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if self.config.torch_threads:  # the server's torch threads, as the benchmark's own
            env["OMP_NUM_THREADS"] = str(self.config.torch_threads)
        with open(self.log_path, "w", encoding="utf-8") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(self.command(config_path), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT)
        atexit.register(self.stop)
        try:
            self._wait_healthy(self.config.http.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, timeout: float) -> None:
        wait_healthy(self.process, self.url, self.log_path, timeout)

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def metrics(self) -> dict[tuple[str, str], float]:
        """The server's Prometheus samples: {(name, labels text): value} (e.g. ("flide_round_requests_sum", ""))."""
        return prometheus_samples(self.url)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGINT, then SIGKILL after `timeout` seconds; returns the exit code (None if it never started)."""
        process, self.process = self.process, None
        atexit.unregister(self.stop)
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
