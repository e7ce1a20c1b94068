"""How long a long prompt stalls another client's stream on `specdecode serve`, and its TTFT.

    python scripts/prefill_stall.py [--model M] [--prompt-tokens 4000] [--stream-tokens 300]
        [--serve "specdecode serve"] [--llamacpp-server PATH] [--transformers] [--skip-ours]

Starts the server (the command in --serve, so another checkout can be measured the same way),
opens a streaming request that decodes --stream-tokens tokens, and once that stream flows sends
a completion whose prompt is --prompt-tokens token ids (max_tokens 1). Prints the stream's
longest gap between two chunks (the stall) and the long request's time to its answer (its TTFT),
then that request's TTFT again once the stream has ended (alone, as the peers are timed).
With --llamacpp-server, also the prompt-processing time llama.cpp reports for the same token ids
on the same GGUF file, with 2 threads. With --transformers, also the time transformers takes for
the same ids in one forward (the first token's logits only) on the dequantized float32 weights,
with 2 threads: transformers runs no GGUF kernels, so this is its best path on this model.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import threading
import time
import urllib.request
from pathlib import Path

from specdecode.bench.llamacpp import ServerProcess, peer_gguf


def _post(url: str, body: dict, timeout: float = 900) -> urllib.request.addinfourl:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def measure_ours(serve: str, model: str, prompt_ids: list[int], stream_tokens: int) -> dict:
    server = ServerProcess([*shlex.split(serve), "--model", model, "--max-seq-len", "8192", "--log-level", "warning"],
                           Path("/dev/null"))
    url = server.start().url
    try:
        arrivals: list[float] = []

        def stream() -> None:
            body = {"model": model, "prompt": "def fibonacci(n):", "max_tokens": stream_tokens, "stream": True,
                    "ignore_eos": True}
            with _post(url + "/v1/completions", body) as resp:
                for line in resp:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.perf_counter())

        reader = threading.Thread(target=stream)
        reader.start()
        while len(arrivals) < 5:
            time.sleep(0.05)
        start = time.perf_counter()
        with _post(url + "/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": 1}) as resp:
            resp.read()
        ttft = time.perf_counter() - start
        reader.join()
        start = time.perf_counter()
        with _post(url + "/v1/completions", {"model": model, "prompt": prompt_ids, "max_tokens": 1}) as resp:
            resp.read()
        alone = time.perf_counter() - start
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        return {"longest_stall_s": round(max(gaps), 2), "median_gap_s": round(sorted(gaps)[len(gaps) // 2], 3),
                "long_prompt_ttft_s": round(ttft, 2), "long_prompt_ttft_alone_s": round(alone, 2),
                "stream_chunks": len(arrivals)}
    finally:
        server.stop()


def measure_llamacpp(server: str, model: str, prompt_ids: list[int]) -> dict:
    from specdecode.models.catalog import resolve_model

    gguf = peer_gguf(resolve_model(model))
    llama = ServerProcess([server, "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "8192", "-np", "1"],
                          Path("/dev/null"))
    llama.start()
    try:
        start = time.perf_counter()
        with _post(llama.url + "/completion", {"prompt": prompt_ids, "n_predict": 1, "cache_prompt": False}) as resp:
            timings = json.loads(resp.read())["timings"]
        return {"long_prompt_ttft_s": round(time.perf_counter() - start, 2),
                "prompt_ms_reported": round(timings["prompt_ms"])}
    finally:
        llama.stop()


def measure_transformers(model: str, prompt_ids: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from specdecode.models.catalog import resolve_model
    from specdecode.models.gguf_convert import write_float_weights

    folder = resolve_model(model)
    write_float_weights(folder)
    torch.set_num_threads(2)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        start = time.perf_counter()
        logits = hf(torch.tensor([prompt_ids]), logits_to_keep=1).logits
        elapsed = time.perf_counter() - start
    return {"long_prompt_ttft_s": round(elapsed, 2), "first_token": int(logits[0, -1].argmax()),
            "settings": "float32, sdpa attention, 2 threads, one forward"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--stream-tokens", type=int, default=300)
    ap.add_argument("--serve", default="specdecode serve", help="the command that starts our server")
    ap.add_argument("--llamacpp-server", default=None, help="also time llama.cpp's prefill of the same ids")
    ap.add_argument("--transformers", action="store_true", help="also time transformers' forward of the same ids")
    ap.add_argument("--skip-ours", action="store_true", help="time only the peers asked for")
    args = ap.parse_args()
    rng = random.Random(0)
    prompt_ids = [rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)]
    result: dict = {"model": args.model, "prompt_tokens": args.prompt_tokens, "serve": args.serve}
    if not args.skip_ours:
        result["ours"] = measure_ours(args.serve, args.model, prompt_ids, args.stream_tokens)
    if args.transformers:
        result["transformers"] = measure_transformers(args.model, prompt_ids)
    if args.llamacpp_server:
        result["llamacpp"] = measure_llamacpp(args.llamacpp_server, args.model, prompt_ids)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
