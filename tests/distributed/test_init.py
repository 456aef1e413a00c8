"""Initial weights do not depend on the layout: every strategy at every world size starts from exactly
the weights one process builds (`build_model(cfg.model, train.seed)`), although each rank draws only
the part it keeps, from a model built on the meta device."""

from __future__ import annotations

import torch

from tests.support.harness import run_distributed
from tests.support.reference import LLAMA
from zerodp.config import load_config
from zerodp.models import build_model
from zerodp.models.common import INIT_BLOCK, normal_range


def initial_weights(runs: list[list[str]]) -> list[dict[str, torch.Tensor]]:
    """Runs on every rank: per config, the strategy's full fp32 weights right after setup (no step)."""
    from zerodp.distributed.process_group import init_distributed
    from zerodp.strategies import RunContext, make_strategy

    env = init_distributed("cpu")
    out = []
    for overrides in runs:
        cfg = load_config(None, overrides)
        strategy = make_strategy(cfg.strategy.name)
        strategy.setup(build_model(cfg.model, device="meta"),
                       RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 1))
        out.append(strategy.full_state_dict())
    return out


def test_initial_weights_are_identical_under_every_layout(tiny):
    """Both families under single, zero3 at world 3 and fsdp at world 2 (uneven shards), ddp at world 2,
    and zero1/zero2/zero3 in bf16 (a 16-bit working copy; the fp32 master weights are set from the exact
    values): bit-identical to the weights one process builds. One process group per world size."""
    archs = {"gpt2": tiny, "llama": tiny + LLAMA}
    layouts = {1: [["strategy.name=single"]],
               2: [["strategy.name=fsdp"], ["strategy.name=ddp"], ["strategy.name=zero1", "train.precision=bf16"],
                   ["strategy.name=zero2", "train.precision=bf16"]],
               3: [["strategy.name=zero3"], ["strategy.name=zero3", "train.precision=bf16"]]}
    want = {a: {n: p.detach() for n, p in build_model(load_config(None, over).model, seed=11).named_parameters()}
            for a, over in archs.items()}
    for world, extras in layouts.items():
        runs = [(a, extra) for a in archs for extra in extras]
        per_rank = run_distributed("tests.distributed.test_init:initial_weights", world, {"runs": [
            archs[a] + extra + ["train.seed=11"] for a, extra in runs]})
        for rank, results in enumerate(per_rank):
            for (a, extra), got in zip(runs, results):
                assert got.keys() == want[a].keys(), (a, extra, sorted(set(got) ^ set(want[a])))
                for name, value in want[a].items():
                    assert torch.equal(got[name], value), (a, extra, world, rank, name)


def test_a_range_is_the_same_slice_of_the_whole_across_blocks():
    """A rank's range is cut out of the same values whatever the range, across block boundaries."""
    numel = 2 * INIT_BLOCK + 12345
    whole = normal_range(5, "w", numel, 0, numel)
    for start, stop in [(0, 10), (INIT_BLOCK - 7, INIT_BLOCK + 9), (3, 2 * INIT_BLOCK + 100), (numel - 5, numel)]:
        assert torch.equal(normal_range(5, "w", numel, start, stop), whole[start:stop]), (start, stop)
    assert abs(whole.std().item() - 1.0) < 0.01 and abs(whole.mean().item()) < 0.01
    assert not torch.equal(normal_range(6, "w", numel, 0, 100), whole[:100])  # the seed matters
    assert not torch.equal(normal_range(5, "v", numel, 0, 100), whole[:100])  # and so does the name


def test_gpt2_init_rule_and_seed(tiny):
    cfg = load_config(None, tiny)
    a, b = build_model(cfg.model, seed=1), build_model(cfg.model, seed=2)
    assert a.lm_head.weight is a.transformer.wte.weight  # still tied after materialising
    assert not torch.equal(a.transformer.wte.weight, b.transformer.wte.weight)
    assert torch.equal(a.transformer.h[0].ln_1.weight, torch.ones_like(a.transformer.h[0].ln_1.weight))
    assert torch.equal(a.transformer.h[0].attn.c_attn.bias, torch.zeros_like(a.transformer.h[0].attn.c_attn.bias))
