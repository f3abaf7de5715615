"""The Python client of a deployed cluster: ``client = cluster.connect(address)``.

Works from any Ray driver: a script on the desktop (``address="auto"``), a job started with
``ray job submit`` (the job's own cluster), or another machine through the Ray client
(``address="ray://desktop:10001"``). Requests go to the router actor's cluster API as Ray calls.

    client = cluster.connect("auto")
    print(client.generate("def fib(n):", max_tokens=64)["text"])
    for piece in client.stream(messages=[{"role": "user", "content": "hi"}]):
        print(piece, end="")
    client.batch("prompts.jsonl", "answers.jsonl")  # resumable, with a progress bar
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from tqdm import tqdm

# Loaded here, on the importing thread, and not later by ``ray.get_actor``: Ray unpickles the router's
# class inside its core worker, and torch (which the router's serving modules pull in) loaded there
# fails in a job's driver with "oneMKL FATAL ERROR: Cannot load libtorch_cpu.so".
from hearth.cluster import router as _router  # noqa: F401
from hearth.cluster.specs import NAMESPACE, ROUTER_NAME


class HearthError(RuntimeError):
    """A request the cluster refused or failed (status and message as the HTTP API gives them)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class HearthClient:
    """Generation against the router of a running deployment."""

    def __init__(self, router: Any) -> None:
        self.router = router

    @staticmethod
    def _request(prompt: str | list[int] | None, messages: list[dict[str, Any]] | None,
                 fields: dict[str, Any]) -> dict[str, Any]:
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or messages")
        request = {"prompt": prompt} if prompt is not None else {"messages": messages}
        return {**request, **{k: v for k, v in fields.items() if v is not None}}

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
                 **fields: Any) -> dict[str, Any]:
        """One completion: ``text``, ``token_ids``, ``finish_reason``, ``usage``, ``timings``.
        ``fields``: max_tokens, temperature, top_p, top_k, min_p, seed, stop, ignore_eos, session_id."""
        result = ray.get(self.router.generate.remote(self._request(prompt, messages, fields)))
        if "error" in result:
            raise HearthError(result["error"]["status"], result["error"]["message"])
        return result

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict[str, Any]] | None = None,
               **fields: Any) -> Iterator[str]:
        """The completion's text as it is generated."""
        for ref in self.router.stream.remote(self._request(prompt, messages, fields)):
            item = ray.get(ref)
            if "error" in item:
                raise HearthError(item["error"]["status"], item["error"]["message"])
            if "finish_reason" not in item:
                yield item["text"]

    def batch(self, input_path: str | Path, output_path: str | Path, concurrency: int = 8,
              show_progress: bool = True, **defaults: Any) -> int:
        """Run every request of a JSONL file (one object per line: ``prompt`` or ``messages``, an
        optional ``id`` and sampling fields; ``defaults`` fill what a line leaves out) and append
        one result per line to ``output_path``. Lines whose id is already in the output are
        skipped, so an interrupted batch resumes where it stopped. Returns the results written."""
        requests = _read_requests(Path(input_path), defaults)
        done = _done_ids(Path(output_path))
        todo = [r for r in requests if r["id"] not in done]
        written = 0
        with open(output_path, "a") as out, tqdm(total=len(requests), initial=len(requests) - len(todo),
                                                 disable=not show_progress, desc="hearth batch", unit="req") as bar:
            pending: list[Any] = []
            queue = iter(todo)
            while True:
                while len(pending) < concurrency and (request := next(queue, None)) is not None:
                    pending.append(self.router.generate.remote(request))
                if not pending:
                    break
                ready, pending = ray.wait(pending, num_returns=1)
                out.write(json.dumps(ray.get(ready[0]), ensure_ascii=False) + "\n")
                out.flush()
                written += 1
                bar.update(1)
        return written

    def status(self) -> dict[str, Any]:
        """The deployment: model, URL and replicas."""
        return ray.get(self.router.describe.remote())


def _read_requests(path: Path, defaults: dict[str, Any]) -> list[dict[str, Any]]:
    requests = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{path}:{n}: each line must be a JSON object")
            requests.append({**defaults, **item, "id": item.get("id", n)})
    ids = [r["id"] for r in requests]
    if len(set(map(str, ids))) != len(ids):
        raise ValueError(f"{path}: request ids must be unique")
    return requests


def _done_ids(path: Path) -> set:
    if not path.exists():
        return set()
    done = set()
    with open(path) as f:
        for line in f:
            try:
                done.add(json.loads(line)["id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by an interruption: that request runs again
    return done


def _init(address: str, attempts: int = 3) -> None:
    """``ray.init``; through the Ray client, retried: the head starts a server process per client,
    and that start can fail on a busy machine ("Starting Ray client server failed")."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
            return
        except ConnectionError:
            if not address.startswith("ray://") or attempt == attempts:
                raise
            time.sleep(2.0 * attempt)


def connect(address: str = "auto") -> HearthClient:
    """Connect to the cluster at ``address`` (``auto``, ``host:6379`` or ``ray://host:10001``) and
    return a client of its deployment. Reuses an existing Ray connection."""
    if not ray.is_initialized():
        _init(address)
    try:
        router = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    except ValueError:
        raise RuntimeError("nothing is deployed on this cluster (start it with `hearth up --model DIR`)") from None
    return HearthClient(router)
