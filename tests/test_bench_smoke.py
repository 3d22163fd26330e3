"""The benchmarks run end to end on a tiny model with tiny sizes and report what their READMEs promise.

Speeds are never asserted (the machine is shared); what is checked is the report's shape, the
weight accounting, and the exactness the benchmarks rely on: tp=2 decodes the tokens of tp=1, and
batched prefill gives the replies of unbatched prefill.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from daemon import write_daemon_model
from tiny_models import write_tiny_model

from bench.attention import time_kernel
from bench.batched_prefill import run_batched_prefill
from bench.collectives import run_collectives
from bench.common import percentile
from bench.concurrency import run_concurrency
from bench.control_traffic import run_traffic
from bench.decode_roofline import run_decode_roofline, weight_bytes_per_token
from bench.drafts import run_drafts
from bench.fp16_linear import run_fp16_linear
from bench.mxfp4_linear import run_mxfp4_linear
from bench.q6_linear import run_q6_linear
from bench.q8_linear import run_q8_linear
from bench.shared_prefix import main as shared_prefix_main
from bench.shm_exchange import run_exchange
from bench.vision_ttft import main as vision_ttft_main
from tpserve.kernels.fp16_linear import supported_paths as fp16_paths
from tpserve.kernels.int8_linear import int8_available
from tpserve.kernels.native_attention import attention_paths, native_unavailable
from tpserve.ranks.model_config import load_model_config

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("bench") / "llama", "llama"))


def test_decode_roofline_reports_every_mode_and_tp2_decodes_the_tokens_of_tp1(tiny_model):
    report = run_decode_roofline(tiny_model, num_bursts=2, burst_tokens=2, bandwidth_bytes=2**20)
    modes = {(row["tp_size"], row["batch_invariant"]): row for row in report["modes"]}
    assert set(modes) == {(1, True), (1, False), (2, True), (2, False)}
    for row in modes.values():
        assert row["tokens_per_s"] > 0 and row["bandwidth_gb_s"] > 0
        assert len(row["burst_tokens_per_s"]) == len(row["burst_bandwidth_gb_s"]) == 2
        fractions = [
            rate * row["bytes_per_token"] / (gb_s * 1e9)
            for rate, gb_s in zip(row["burst_tokens_per_s"], row["burst_bandwidth_gb_s"])
        ]
        assert math.isclose(row["roofline_fraction"], statistics.median(fractions))
        assert row["bytes_per_token"] == max(row["rank_bytes_per_token"])
    # The uneven 2+1 KV split: rank 0 reads more and bounds the pair, yet less than tp=1 reads.
    tp1, tp2 = modes[(1, True)], modes[(2, True)]
    assert tp2["rank_bytes_per_token"][0] > tp2["rank_bytes_per_token"][1]
    assert tp1["bytes_per_token"] / 2 < tp2["bytes_per_token"] < tp1["bytes_per_token"]
    assert report["ratios"]["tp2_tokens_equal_tp1_invariant"] is True
    assert report["ratios"]["tp2_tokens_equal_tp1_fast"] is True
    assert set(report["ratios"]) >= {"tp1_invariant_over_fast", "tp2_invariant_over_fast"}


def test_weight_bytes_count_every_weight_once_with_replicated_norms_on_each_rank(tiny_model):
    config = load_model_config(tiny_model)
    whole = weight_bytes_per_token(config, 0, 1, 4)
    halves = [weight_bytes_per_token(config, rank, 2, 4) for rank in (0, 1)]
    num_norm_params = config.hidden_size * (2 * config.num_layers + 1)
    assert sum(halves) == whole + 4 * num_norm_params


def test_concurrency_reports_each_stream_count_against_the_first(tiny_model):
    # Long enough that the three streams all decode at once even when the machine staggers their
    # admissions (the window the bench times is empty otherwise).
    report = run_concurrency(tiny_model, stream_counts=(1, 3), max_tokens=24)
    assert report["num_lanes"] >= 16
    assert [level["streams"] for level in report["levels"]] == [1, 3]
    assert report["levels"][0]["ratio_to_first"] == 1.0
    for level in report["levels"]:
        assert level["tokens_per_s"] > 0 and level["ms_per_round"] > 0


def test_batched_prefill_gives_the_replies_of_unbatched_prefill(tiny_model):
    report = run_batched_prefill(tiny_model, num_requests=4, prompt_tokens=24, max_tokens=4)
    off, on = report["modes"]
    assert (off["batch_prefill"], on["batch_prefill"]) == (False, True)
    assert report["replies_identical"] is True and report["differing_requests"] == []
    assert all(len(reply) == 4 for reply in report["replies"])
    assert len({tuple(reply) for reply in report["replies"]}) > 1  # distinct prompts, distinct replies
    for mode in (off, on):
        (first_token_s,) = mode["round_first_token_s"]
        assert len(first_token_s) == 4
        assert mode["first_token_p50_s"] <= mode["first_token_p90_s"] <= mode["last_first_token_s"]
    assert report["last_first_token_ratio"] == on["last_first_token_s"] / off["last_first_token_s"]


def test_collectives_decode_the_same_tokens_over_shared_memory_gloo_and_one_rank(tiny_model):
    report = run_collectives(tiny_model, prompt_tokens=24, num_prefills=1, num_bursts=2, burst_tokens=3)
    assert [mode["mode"] for mode in report["modes"]] == ["tp=2 gloo", "tp=2 shared memory", "tp=1"]
    for mode in report["modes"]:
        assert mode["prefill_s"] > 0 and mode["decode_tokens_per_s"] > 0
        assert len(mode["token_ids"]) == 6
    assert report["tokens_identical"] is True
    gloo, shared, _ = report["modes"]
    assert report["ratios"]["decode_shared_memory_over_gloo"] == (
        shared["decode_tokens_per_s"] / gloo["decode_tokens_per_s"]
    )


def test_the_exchange_benchmark_sums_alike_in_c_and_python():
    report = run_exchange([1, 16], steps=20, rounds=1)
    assert [row["rows"] for row in report["results"]] == [1, 16]
    for row in report["results"]:
        assert row["C_wall_us"] > 0 and row["Python_wall_us"] > 0
        assert row["python_over_c"] == row["Python_wall_us"] / row["C_wall_us"]
    assert report["same_bits"] is True


def test_drafts_change_no_reply_of_the_benchmark(tiny_model):
    report = run_drafts(tiny_model, task="copy", draft_tokens=7, max_tokens=12)
    assert report["replies_identical"] is True
    assert report["tokens_per_s_off"] > 0 and report["tokens_per_s_on"] > 0
    assert report["drafted"] >= report["accepted"] >= 0


def test_control_traffic_counts_one_message_a_step_and_one_an_idle_spell(tiny_model):
    report = run_traffic(tiny_model, num_streams=4, max_tokens=4, dtype="float32", num_alone=1)
    assert report["streams"] == 6 and report["completion_tokens"] > 0
    assert report["messages_per_step"] == 1 and report["most_messages_in_a_step"] == 1
    assert report["extra_messages_per_request"] == 0 and report["most_votes_in_a_step"] <= 1
    assert report["prompt_only_steps"] >= 2 and report["messages_per_idle_spell"] == 1


def test_a_benchmark_runs_as_a_module_and_writes_its_figures(tiny_model, tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.concurrency", "--model", tiny_model, "--streams", "1", "2"]
        + ["--max-tokens", "5", "--json", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "x 1 stream(s)" in done.stdout
    assert [level["streams"] for level in json.loads(out.read_text())["levels"]] == [1, 2]


def test_the_block_weight_benchmark_times_every_kind_and_the_embedding_lookup():
    report = run_q8_linear(rows=(1, 3), num_copies=2, num_passes=1, shapes=((48, 64),))
    assert [(r["shape"], r["rows"]) for r in report["results"]] == [([48, 64], 1), ([48, 64], 3)]
    for r in report["results"]:
        assert set(r["ms"]) == {"int8", "q4", "q8"} and r["q8_over_int8"] > 0
        assert r["bytes"]["q8"] == 48 * 64 * 34 // 32 and r["bytes"]["q4"] == 48 * 64 * 5 // 8
    assert [r["ids"] for r in report["lookups"]] == [1, 16, 512]


def test_the_float16_benchmark_times_the_kernel_against_the_products_it_replaced():
    if not fp16_paths() or int8_available():
        pytest.skip("needs the C float16 kernel and FBGEMM")
    report = run_fp16_linear(rows=(1, 3), num_copies=2, num_passes=1, shapes=((48, 64),))
    assert [(r["shape"], r["rows"]) for r in report["results"]] == [([48, 64], 1), ([48, 64], 3)]
    for r in report["results"]:
        assert set(r["ms"]) == {"fp16", "fbgemm", "fbgemm16", "float32"} and r["fp16_over_fbgemm"] > 0
        assert r["bytes"]["fp16"] == 2 * 48 * 64 and r["bytes"]["float32"] == 4 * 48 * 64


def test_the_attention_benchmark_times_every_path_this_cpu_runs():
    if why := native_unavailable(64, 3, torch.float32, "cpu"):
        pytest.skip(why)
    paths = attention_paths()
    report = time_kernel(40, 2, 3, paths, num_passes=1)
    assert (report["keys"], report["lanes"], report["tokens"]) == (40, 2, 3)
    assert (
        set(report["ms"]) == set(paths) and "plain" in paths and all(ms > 0 for ms in report["ms"].values())
    )


def test_the_6_bit_benchmark_times_every_kind_with_its_bytes():
    report = run_q6_linear(rows=(1, 3), num_copies=2, num_passes=1, shapes=((48, 64),))
    assert [(r["shape"], r["rows"]) for r in report["results"]] == [([48, 64], 1), ([48, 64], 3)]
    for r in report["results"]:
        assert set(r["ms"]) == {"float32", "q4", "q5f32", "q8", "q6"} and r["q6_over_q4"] > 0
        assert r["bytes"]["q6"] == 48 * 64 * 7 // 8 and r["bytes"]["q5f32"] == 48 * 64 * 7 // 8


def test_the_mxfp4_benchmark_times_every_kind_with_its_bytes():
    report = run_mxfp4_linear(rows=(1, 3), num_copies=2, num_passes=1, shapes=((48, 64),))
    assert [(r["shape"], r["rows"]) for r in report["results"]] == [([48, 64], 1), ([48, 64], 3)]
    for r in report["results"]:
        assert set(r["ms"]) == {"float32", "q4", "q5", "mxfp4"} and r["mxfp4_over_q5"] > 0
        assert r["bytes"]["mxfp4"] == 48 * 64 * 17 // 32 and r["bytes"]["q5"] == 48 * 64 * 3 // 4


def test_percentile_interpolates_between_ranks():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([5.0], 90) == 5.0


def test_the_gpu_check_runs_on_the_cpu_and_writes_one_report(tiny_model, tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--model", tiny_model, "--out", str(out),
         "--lanes", "1,2", "--tokens", "4", "--rounds", "2", "--bandwidth-mib", "8", "--threads", "1",
         "--two-ranks", "yes"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    host = report["host"]
    assert host["cpu_model"] and host["blas"] != "unknown" and host["torch"] == torch.__version__
    assert isinstance(host["vector_extensions"], list) and host["threads"] == 1
    assert report["device"] == "cpu" and report["failed"] == []
    checks = report["checks"]
    assert checks["tp1_float32_vs_cpu"]["max_abs_diff"] == 0.0  # the CPU against itself
    assert checks["bf16_generation"]["of"] == 4
    assert checks["batch_invariance_probe"]["holds"] is True  # on the CPU, where the daemon claims it
    assert any("scaled_dot_product" in name for name in checks["passes"]["sdpa_prefill"])
    assert [row["lanes"] for row in checks["decode"]["rows"]] == [1, 2]
    assert all(row["tokens_per_s"] > 0 and row["of_roof"] > 0 for row in checks["decode"]["rows"])
    assert checks["tp2_equals_tp1"]["equal"] is True
    killed = checks["follower_sigkill"]
    assert killed["ended_with_error_in_time"] is True and killed["stream_error"], killed


def test_quality_reports_perplexity_and_agreement_of_each_format(tiny_model, tmp_path):
    from bench.quality import main as run_quality

    text = tmp_path / "text.txt"
    text.write_text("The lane host admits waiting requests and prefills their prompts. " * 20)
    out = tmp_path / "quality.json"
    argv = ["--model", tiny_model, "--text", str(text), "--max-text-tokens", "400", "--window", "64"]
    argv += ["--prompts", "2", "--tokens", "6", "--threads", "1", "--json", str(out)]
    assert run_quality(argv) == 0
    report = json.loads(out.read_text())
    formats = report["formats"]
    assert set(formats) == {"none", "int8", "int4", "int4/float16"} and report["machine"]["torch"]
    assert formats["none"]["perplexity_vs_reference"] == 1.0 and formats["none"]["agreement"] == 1.0
    for quantized in ("int8", "int4", "int4/float16"):
        assert 1.0 < formats[quantized]["perplexity"] < math.inf
        assert 0.0 <= formats[quantized]["agreement"] <= 1.0
        assert len(formats[quantized]["agreed_tokens"]) == 2


def test_the_shared_prefix_benchmark_finds_one_copy_of_the_system_prompt(tmp_path, capsys):
    # The real daemon on the byte-level tiny model: a system prompt of 200+ tokens is 6+ whole blocks.
    model_dir = write_daemon_model(tmp_path / "chat-model")
    out = tmp_path / "shared.json"
    flags = "--context 512 --threads-per-rank 1 --device cpu"
    argv = ["--model", str(model_dir), "--system-tokens", "200", "--max-tokens", "4", "--flags", flags]
    assert shared_prefix_main([*argv, "--json", str(out)]) == 0, capsys.readouterr().out[-2000:]
    report = json.loads(out.read_text())
    assert [burst["burst"] for burst in report["bursts"]] == ["together", "after the first", "one by one"]
    for burst in report["bursts"]:
        assert burst["num_cold"] == 1 and burst["first_cached_tokens"] == 0
        assert min(burst["others_cached_tokens"]) >= 6 * report["block_size"]
        assert burst["ideal_shared_blocks"] < burst["unshared_blocks"]
    assert {"cpu_model", "vector_extensions", "blas", "torch", "threads"} <= set(report["machine"])


def test_the_vision_ttft_benchmark_times_a_text_an_image_and_a_video_chat_through_the_daemon(
    tmp_path, capsys
):
    # The real two-rank daemon on the tiny Qwen2.5-VL it writes: each chat gives its first token,
    # prefilled cold (never from the cache), and the media widen the prompt by their grids.
    out = tmp_path / "vision.json"
    argv = ["--rounds", "1", "--log", str(tmp_path / "daemon.log"), "--json", str(out)]
    assert vision_ttft_main(argv) == 0, capsys.readouterr().out[-2000:]
    report = json.loads(out.read_text())
    kinds = report["kinds"]
    assert list(kinds) == ["text", "image", "video"]
    # 72x72 pixels: a 6x6 merged grid, 36 positions an image; 8 frames: 4 temporal patches of 36.
    assert kinds["image"]["prompt_tokens"] - kinds["text"]["prompt_tokens"] == 36 + 2
    assert kinds["video"]["prompt_tokens"] - kinds["text"]["prompt_tokens"] == 4 * 36 + 2
    for kind in kinds.values():
        assert kind["engine_ttft_median_ms"] > 0 and kind["ttft_median_ms"] > 0
    assert {"cpu_model", "vector_extensions", "blas", "torch", "threads"} <= set(report["machine"])
