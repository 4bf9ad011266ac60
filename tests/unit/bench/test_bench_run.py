"""The whole `hybridpd bench` command against a fake OpenAI streaming server started in the test."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hybridpd.bench import main

from .fake_openai_server import BYTES_PER_REQUEST


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridpd bench")
    main.add_arguments(parser)
    return main.run(parser.parse_args(argv))


def load_only_result(directory: Path) -> dict:
    files = list(directory.glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def assert_throughputs_are_totals_over_duration(result: dict) -> None:
    duration = result["duration"]
    assert duration > 0
    assert result["request_throughput"] == pytest.approx(result["completed"] / duration, rel=1e-12)
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration, rel=1e-12)
    assert result["total_token_throughput"] == pytest.approx(
        (result["total_input_tokens"] + result["total_output_tokens"]) / duration, rel=1e-12
    )


@pytest.mark.parametrize(
    "dataset_args, num_prompts, prompt_len, output_len",
    [
        (["--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "5",
          "--random-prefix-len", "8"], 12, 32, 5),
        (["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "16",
          "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "3",
          "--prefix-repetition-output-len", "3"], 9, 20, 3),
    ],
)
@pytest.mark.parametrize("traffic_args", [[], ["--request-rate", "400", "--burstiness", "0.5", "--max-concurrency", "2"]])
def test_bench_synthetic_run_counts_every_token(
    fake_server, tmp_path, capsys, dataset_args, num_prompts, prompt_len, output_len, traffic_args
):
    server = fake_server(vocab_size=100)
    code = run_bench([
        "--base-url", server.base_url, *dataset_args, "--num-prompts", str(num_prompts), *traffic_args,
        "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path), "--label", "t",
        "--metrics-url", server.base_url + "/metrics", "--goodput", "ttft:60000", "e2el:60000",
        "--metric-percentiles", "50,99",
    ])
    printed = capsys.readouterr().out
    assert code == 0
    result = load_only_result(tmp_path)
    assert result["completed"] == num_prompts and result["failed"] == 0
    assert result["model_id"] == "fake-model" and result["label"] == "t" and result["backend"] == "openai"
    assert result["total_input_tokens"] == num_prompts * prompt_len
    assert result["total_output_tokens"] == num_prompts * output_len
    assert result["input_lens"] == [prompt_len] * num_prompts
    assert result["output_lens"] == [output_len] * num_prompts
    assert all(len(gaps) == output_len - 1 for gaps in result["itls"])
    assert_throughputs_are_totals_over_duration(result)
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["prefix_cache_hit_rate"] == pytest.approx((prompt_len // 2) / prompt_len)
    assert result["kv_bytes_read"] == num_prompts * sum(BYTES_PER_REQUEST.values())
    assert {"p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "std_itl_ms", "median_e2el_ms"} <= result.keys()
    if "--max-concurrency" in traffic_args:
        assert 1 <= result["max_concurrent_requests"] <= 2 and result["max_concurrency"] == 2
        assert result["request_rate"] == 400
    else:
        assert result["request_rate"] == "inf"
    # Synthetic data asks for exact lengths: ignore_eos is on, ids stay under the server's vocabulary.
    assert all(body["ignore_eos"] is True and body["stream"] is True for body in server.state.bodies)
    assert all(max(body["prompt"]) < 100 for body in server.state.bodies)
    for line in ("============ Serving Benchmark Result ============", "Successful requests:",
                 "Benchmark duration (s):", "---------------Time to First Token----------------",
                 "Mean TTFT (ms):", "P99 ITL (ms):", "Prefix cache hit rate:", "KV bytes read:"):
        assert line in printed
    assert f"Result saved to {tmp_path}" in printed


def test_bench_counts_failed_requests_without_crashing(fake_server, tmp_path, capsys):
    server = fake_server(fail_ordinals=frozenset({1, 4}), midstream_fail_ordinals=frozenset({6}))
    code = run_bench([
        "--base-url", server.base_url, "--random-input-len", "10", "--random-output-len", "4",
        "--num-prompts", "10", "--max-concurrency", "1", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path),
    ])
    printed = capsys.readouterr().out
    assert code == 0
    result = load_only_result(tmp_path)
    assert (result["completed"], result["failed"]) == (7, 3)
    assert result["total_input_tokens"] == 7 * 10 and result["total_output_tokens"] == 7 * 4
    assert_throughputs_are_totals_over_duration(result)
    errors = [e for e in result["errors"] if e]
    assert len(errors) == 3
    assert sum("injected failure" in e for e in errors) == 2 and sum("mid-stream" in e for e in errors) == 1
    assert "Failed requests during benchmark run detected" in printed
    assert result["kv_bytes_read"] is None  # no --metrics-url
    assert len(list(tmp_path.glob("openai-infqps-concurrency1-fake-model-*-*.json"))) == 1  # vLLM's default name


def test_bench_chat_endpoint_with_custom_text_prompts(fake_server, tmp_path):
    server = fake_server()
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "hello there", "output_tokens": 3}\n\n{"prompt": "hi"}\n')
    result_file = tmp_path / "out" / "chat.json"
    code = run_bench([
        "--base-url", server.base_url, "--endpoint", "/v1/chat/completions", "--model", "fake-model",
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "2",
        "--num-prompts", "4", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path / "out"),
        "--result-filename", "chat.json",
    ])
    assert code == 0
    result = json.loads(result_file.read_text())
    assert (result["completed"], result["failed"], result["backend"]) == (4, 0, "openai-chat")
    # Two lines oversampled to four prompts: both lines sent, each with its own or the default length.
    assert set(zip(result["input_lens"], result["output_lens"])) == {(len("hello there"), 3), (len("hi"), 2)}
    assert all("ignore_eos" not in body for body in server.state.bodies)  # off for custom data


@pytest.mark.parametrize(
    "argv_tail, message",
    [
        (["--endpoint", "/v1/chat/completions"], "needs text prompts"),
        (["--random-range-ratio", "1.5"], "--random-range-ratio"),
        (["--goodput", "ttft=5"], "KEY:VALUE"),
        (["--dataset-name", "custom"], "--dataset-path"),
    ],
)
def test_bench_rejects_bad_arguments_with_exit_2(fake_server, capsys, argv_tail, message):
    server = fake_server()
    assert run_bench(["--base-url", server.base_url, "--num-prompts", "2", "--disable-tqdm", *argv_tail]) == 2
    assert message in capsys.readouterr().out
    assert server.state.received == 0


def test_bench_unreachable_server_exits_2(capsys):
    assert run_bench(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--disable-tqdm"]) == 2
    assert "/v1/models" in capsys.readouterr().out


def test_bench_plot_writes_png_from_results(fake_server, tmp_path):
    server = fake_server()
    results = []
    for label in ("a", "b"):
        out_dir = tmp_path / label
        assert run_bench([
            "--base-url", server.base_url, "--random-input-len", "8", "--random-output-len", "4",
            "--num-prompts", "4", "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--label", label,
        ]) == 0
        results.append(str(next(out_dir.glob("*.json"))))
    png = tmp_path / "plots" / "latency.png"
    assert run_bench(["plot", *results, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("content", ["not json", '{"completed": 3}', "[1, 2]"])
def test_bench_plot_rejects_a_file_that_is_not_a_result(tmp_path, capsys, content):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert run_bench(["plot", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert "bad.json" in capsys.readouterr().out
    assert not (tmp_path / "x.png").exists()


def test_bench_result_returns_the_result_dict_for_scripts(fake_server, tmp_path, monkeypatch):
    server = fake_server()
    monkeypatch.chdir(tmp_path)  # where a default-named result would land
    result = main.bench_result([
        "--base-url", server.base_url, "--random-input-len", "6", "--random-output-len", "2",
        "--num-prompts", "3", "--disable-tqdm",
    ])
    assert (result["completed"], result["total_input_tokens"], result["total_output_tokens"]) == (3, 18, 6)
    assert not list(tmp_path.iterdir())  # nothing saved without --save-result
