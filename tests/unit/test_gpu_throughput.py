"""benchmarks/gpu_throughput.py stays runnable: its real model shapes are configs the loader accepts, of the
sizes the script names, and the planner it prints beside each run says where they fit on 8 H200s.
(A whole run of the script, `--tiny` on CPU, takes about 15 s a row and is left to the benchmark itself.)"""

from __future__ import annotations

import importlib.util

from tests.support.harness import ROOT
from zerodp.config import load_config
from zerodp.models import param_count


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_throughput", ROOT / "benchmarks" / "gpu_throughput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_shapes_load_and_the_planner_places_them(tmp_path):
    bench = load_script()
    sizes = {}
    for model, shape in bench.MODELS.items():
        over = bench.overrides(shape, "fsdp", True, 20, 4, 8, "bf16", tmp_path)
        sizes[model] = param_count(load_config(str(ROOT / "configs/tiny.yaml"), over).model)
        for strategy in bench.STRATEGIES:
            fitting, e = bench.planned(bench.overrides(shape, strategy, False, 20, 4, 8, "bf16", tmp_path), 8,
                                       141 * 2**30, "NVIDIA H200")
            assert e.step_s > 0 and e.tokens_per_s_per_gpu > 0
            if strategy in ("zero3", "fsdp"):  # fully sharded: a 1-1.5B model fits 8 x 141 GiB easily
                assert fitting is not None, (model, strategy)
    assert 1.45e9 < sizes["gpt2-xl"] < 1.65e9, sizes
    assert 1.1e9 < sizes["llama-1b"] < 1.35e9, sizes
