"""Batch generation over a JSONL file against a hearth deployment.

Runs as a Ray job (on the cluster):

    ray job submit --address http://DESKTOP:8265 --working-dir deploy/examples -- \
        python batch_job.py --input prompts.jsonl --output /tmp/answers.jsonl

or from any machine through the Ray client:

    python deploy/examples/batch_job.py --address ray://DESKTOP:10001 \
        --input deploy/examples/prompts.jsonl --output answers.jsonl

Each input line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}`` with
optional sampling fields; each output line is the request's id with its text, token ids, finish
reason, usage and timings (or an ``error``). Rerunning resumes: ids already in the output are skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hearth import cluster


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default="auto", help="auto (inside a job), HOST:PORT or ray://HOST:10001")
    p.add_argument("--input", required=True, help="JSONL of requests")
    p.add_argument("--output", required=True, help="JSONL of results (appended; resumable)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=64, help="default max_tokens for lines without one")
    args = p.parse_args()
    # Absolute paths first: connecting to Ray may change the working directory of a job's driver.
    source, target = Path(args.input).resolve(), Path(args.output).resolve()
    client = cluster.connect(args.address)
    print("deployment:", json.dumps({k: v for k, v in client.status().items() if k in ("model", "url")}))
    written = client.batch(source, target, concurrency=args.concurrency, max_tokens=args.max_tokens,
                           temperature=0.0)
    print(f"wrote {written} result(s) to {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
