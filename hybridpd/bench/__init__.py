"""`hybridpd bench`: a `vllm bench serve`-like client (datasets, streaming client, metrics, reports, plots).

A run: build the prompts (datasets.py), pace them (arrivals.py), send each one over one shared
aiohttp session and record its timings (client.py, runner.py), turn the timings into vLLM's
metrics (metrics.py) and print/save them (report.py). `hybridpd bench plot` draws saved results.
"""
