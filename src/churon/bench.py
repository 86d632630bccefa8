"""Benchmarks. `serve`: a load generator for any OpenAI-compatible server.

For each concurrency level, that many clients send streaming /v1/completions requests
back to back until the level's requests are done, and we measure what a user sees:
output tokens/s and requests/s over the level's wall time, time to first token, and the
latency between streamed chunks (inter-token latency). Prompts are random words (about
one token each), different for every request, so no server gets a prefix-cache advantage.

Every request asks for exactly output_len tokens: max_tokens, plus the vendor field
`ignore_eos` (churon, vLLM); servers that know neither can be given their own field with
extra_body (llama-cpp-python's server: {"min_tokens": N}). Output tokens are counted from
the stream's final usage (stream_options.include_usage) when the server sends one, else
one per streamed chunk that carries text.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import httpx2 as httpx

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point government "
    "company number group problem fact water room mother area money story month lot right study book job word "
    "business issue side kind head house service friend father power hour game line end member law car city name "
    "team minute idea kid body back parent face others level office door health art war history party result change "
    "morning reason research girl guy moment air teacher force education"
).split()


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float = 0.0  # seconds from sending to the first text chunk
    latency: float = 0.0  # seconds from sending to the end of the stream
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between consecutive text chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from usage, when the server reports it


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    short_outputs: int  # completed requests with fewer tokens than asked (a server that ignored ignore_eos, or cut streams)
    mean_prompt_tokens: float | None
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float
    itl_p95_ms: float
    first_error: str | None = None


def synthetic_prompts(n: int, length: int, seed: int = 0) -> list[str]:
    """n prompts of `length` random words (about a token each), each different from its first word."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(length)) for _ in range(n)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    result = RequestResult(ok=False)
    start = time.perf_counter()
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = f"stream error: {event['error']}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                    result.prompt_tokens = event["usage"].get("prompt_tokens")
                if any(c.get("text") for c in event.get("choices") or []):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.chunk_gaps.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = last is not None
    if not result.ok:
        result.error = "the stream carried no text"
    return result


async def run_level(
    url: str, model: str, prompts: Sequence[str], output_len: int, concurrency: int,
    extra_body: dict[str, Any] | None = None, api_key: str | None = None,
) -> LevelResult:
    """Send every prompt, `concurrency` at a time, and measure."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pending = list(reversed(prompts))
    results: list[RequestResult] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            prompt = pending.pop()
            body = {
                "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True,
            } | (extra_body or {})
            results.append(await one_request(client, url, body))

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    gaps = [g for r in ok for g in r.chunk_gaps]
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    ms = 1000.0
    return LevelResult(
        concurrency=concurrency,
        num_requests=len(prompts),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration,
        output_tokens=output_tokens,
        short_outputs=sum(r.output_tokens < output_len for r in ok),
        mean_prompt_tokens=statistics.mean(prompt_counts) if prompt_counts else None,
        output_tokens_per_s=output_tokens / duration,
        requests_per_s=len(ok) / duration,
        ttft_p50_ms=percentile([r.ttft for r in ok], 50) * ms,
        ttft_p95_ms=percentile([r.ttft for r in ok], 95) * ms,
        itl_p50_ms=percentile(gaps, 50) * ms,
        itl_p95_ms=percentile(gaps, 95) * ms,
        first_error=next((r.error for r in results if not r.ok), None),
    )


async def served_models(url: str, api_key: str | None = None) -> list[str]:
    """The models a server lists at /v1/models ([] when it has no such route); a clear error when it is unreachable."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30.0, headers=headers) as client:
        try:
            response = await client.get(f"{url}/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
        if response.status_code != 200:
            return []
        return [m["id"] for m in response.json().get("data") or []]


def bench_serve(
    url: str, concurrency: Sequence[int], num_requests: Sequence[int], prompt_len: int, output_len: int,
    model: str | None = None, extra_body: dict[str, Any] | None = None, api_key: str | None = None, seed: int = 0,
) -> list[LevelResult]:
    """One LevelResult per concurrency level (num_requests[i] requests at concurrency[i])."""
    if len(num_requests) != len(concurrency):
        raise ValueError(f"{len(num_requests)} request counts for {len(concurrency)} concurrency levels")
    for name, values in (("concurrency", concurrency), ("num_requests", num_requests)):
        if any(v < 1 for v in values):
            raise ValueError(f"{name} must be >= 1, got {list(values)}")
    if prompt_len < 1 or output_len < 1:
        raise ValueError(f"prompt_len and output_len must be >= 1, got {prompt_len} and {output_len}")
    url = url.rstrip("/")

    async def main() -> list[LevelResult]:
        listed = await served_models(url, api_key)  # also: is anyone there, before a long run of failures
        if model is None and not listed:
            raise ValueError(f"{url}/v1/models lists no model; pass --model")
        name = model or listed[0]
        # one untimed request first: a server's first one pays for lazy set-up (allocations, caches)
        warmup = await run_level(url, name, synthetic_prompts(1, prompt_len, seed - 1), 4, 1, extra_body, api_key)
        if warmup.failed:
            raise ValueError(f"the warm-up request to {url} failed: {warmup.first_error}")
        results = []
        for i, (c, n) in enumerate(zip(concurrency, num_requests)):
            prompts = synthetic_prompts(n, prompt_len, seed + i)
            results.append(await run_level(url, name, prompts, output_len, c, extra_body, api_key))
        return results

    return asyncio.run(main())


def format_table(results: Sequence[LevelResult]) -> str:
    header = ["concurrency", "requests", "failed", "output tok/s", "req/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms"]
    rows = [[str(r.concurrency), str(r.completed), str(r.failed), f"{r.output_tokens_per_s:.1f}", f"{r.requests_per_s:.2f}",
             f"{r.ttft_p50_ms:.0f}", f"{r.ttft_p95_ms:.0f}", f"{r.itl_p50_ms:.1f}", f"{r.itl_p95_ms:.1f}"] for r in results]
    widths = [max(len(x) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json(results: Sequence[LevelResult], **settings: Any) -> dict[str, Any]:
    return {"settings": settings, "results": [asdict(r) for r in results]}


def pyplot():
    """matplotlib's pyplot (file output only), or a clear error: it is not a churon dependency."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib, which is not installed (pip install matplotlib)") from None
    return plt


def plot(results: Sequence[LevelResult], path: str) -> None:
    """Output tokens/s against TTFT p95, one point per concurrency level."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r.ttft_p95_ms for r in results], [r.output_tokens_per_s for r in results], marker="o")
    for r in results:
        ax.annotate(f"c={r.concurrency}", (r.ttft_p95_ms, r.output_tokens_per_s))
    ax.set_xlabel("time to first token p95 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.grid(True)
    fig.tight_layout()
    fig.savefig(path)
