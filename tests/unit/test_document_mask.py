"""Document masking (zerodp.models.docmask): a packed sample with doc_ids computes exactly what each of
its documents alone computes, for every family (positions restart, attention stays in the document);
all-equal doc_ids are the unmasked forward; one mask serves every block; the kernel choice."""

from __future__ import annotations

import pytest
import torch

from zerodp.config import Config, ModelConfig
from zerodp.errors import ConfigError
from zerodp.models import build_model
from zerodp.models.docmask import document_mask, document_positions, kernel

FAMILIES = {
    "gpt2": ModelConfig(n_layer=2, n_head=4, n_embd=32, vocab_size=64, block_size=32),
    "llama": ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48,
                         vocab_size=64, block_size=32),
    "qwen3": ModelConfig(arch="qwen3", n_layer=2, n_head=4, n_kv_head=2, head_dim=12, n_embd=32,
                         intermediate_size=48, vocab_size=64, block_size=32),
}
LENGTHS = ((10, 13, 9), (5, 20, 7))
"""Per row, the lengths of its 3 documents (T = 32); the first is a document cut by the window."""


def packed(seed: int = 0):
    """Tokens (2, 32), doc_ids (2, 32) and each row's documents as (tokens, row, start)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 32), generator=g)
    doc_ids = torch.cat([torch.repeat_interleave(torch.tensor([4, 9, 11]), torch.tensor(n))[None] for n in LENGTHS])
    docs = []
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for n in lengths:
            docs.append((x[row : row + 1, start : start + n], row, start))
            start += n
    return x, doc_ids, docs


def model_for(family: str, **changes):
    cfg = ModelConfig(**{**FAMILIES[family].__dict__, **changes})
    return build_model(cfg, seed=3).eval()


def test_positions_restart_at_each_document():
    doc_ids = torch.tensor([[3, 3, 5, 5, 5, 8, 8, 8], [0, 0, 0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 2, 2, 2, 2]])
    assert document_positions(doc_ids).tolist() == [[0, 1, 0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1],
                                                     list(range(8))]


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sample_computes_each_document_alone(family):
    model = model_for(family)
    x, doc_ids, docs = packed()
    with torch.no_grad():
        together = model(x, None, doc_ids)  # positional, as strategy.model(x, y, doc_ids)
        unmasked = model(x)
        worst, unmasked_worst = 0.0, 0.0
        for tokens, row, start in docs:
            alone = model(tokens)[0]
            n = tokens.shape[1]
            worst = max(worst, (together[row, start : start + n] - alone).abs().max().item())
            if start:  # the first document of a row sees only itself either way
                unmasked_worst = max(unmasked_worst, (unmasked[row, start : start + n] - alone).abs().max().item())
    assert worst <= 1e-5
    assert unmasked_worst > 1e-2  # without the mask (and restarted positions) the documents mix


@pytest.mark.parametrize("family", FAMILIES)
def test_one_document_is_the_unmasked_forward_exactly(family):
    model = model_for(family)
    x, _, _ = packed(1)
    with torch.no_grad():
        assert torch.equal(model(x, None, torch.full_like(x, 7)), model(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_of_the_packed_loss_is_the_documents_token_weighted(family):
    """Mean loss over the packed tokens = sum over documents of (tokens / all tokens) x its own mean loss:
    their gradients agree, so the gradient flows through the masked path to every parameter."""
    x, doc_ids, docs = packed(2)
    y = torch.randint(0, 64, x.shape, generator=torch.Generator().manual_seed(5))
    packed_model, alone_model = model_for(family).train(), model_for(family).train()
    packed_model(x, y, doc_ids).backward()
    for tokens, row, start in docs:
        n = tokens.shape[1]
        (alone_model(tokens, y[row : row + 1, start : start + n]) * n / x.numel()).backward()
    for (name, p), q in zip(packed_model.named_parameters(), alone_model.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_activation_checkpointing_under_the_mask_gives_the_same_gradients(family):
    x, doc_ids, _ = packed(3)
    y = torch.roll(x, -1, dims=1)
    grads = []
    for ckpt in (False, True, "selective"):
        model = model_for(family, activation_checkpointing=ckpt).train()
        loss = model(x, y, doc_ids)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    for other in grads[1:]:
        assert grads[0][0] == other[0]
        for a, b in zip(grads[0][1], other[1]):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("family", FAMILIES)
def test_flex_attention_on_the_cpu_matches_the_mask(family):
    """torch's flex attention runs forward-only on the CPU: its block mask gives the mask path's logits."""
    x, doc_ids, _ = packed(4)
    with torch.no_grad():
        flex = model_for(family, document_attention="flex")(x, None, doc_ids)
        sdpa = model_for(family, document_attention="sdpa")(x, None, doc_ids)
    assert (flex - sdpa).abs().max().item() <= 1e-5


@pytest.mark.parametrize("autocast", [False, True])
def test_every_block_saves_the_one_mask(autocast):
    """The sdpa mask is built once per forward in the compute dtype: each block's SDPA saves that same
    tensor for backward (a boolean mask would be converted, and saved, once per block)."""
    model = model_for("llama", n_layer=3).train()
    x, doc_ids, _ = packed(5)
    saved = []

    def pack(t):
        if t.dim() == 4 and t.shape[-2:] == (32, 32):
            saved.append((t.data_ptr(), t.dtype))
        return t

    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with ctx, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, torch.roll(x, -1, dims=1), doc_ids)
    assert len(saved) == 3 and len(set(saved)) == 1
    assert saved[0][1] == (torch.bfloat16 if autocast else torch.float32)


def test_the_mask_is_causal_and_within_documents():
    doc_ids = torch.tensor([[1, 1, 2, 2, 2]])
    mask = document_mask(doc_ids, "sdpa", torch.float32)[0, 0]
    allowed = (mask == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert mask.shape == (5, 5) and torch.isinf(mask).sum() == 25 - 9


def test_kernel_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel("auto", cpu, 0.0) == "sdpa"
    assert kernel("auto", cuda, 0.0) == "flex"
    assert kernel("auto", cuda, 0.1) == "sdpa"  # flex has no dropout
    assert kernel("sdpa", cuda, 0.0) == "sdpa"
    with torch.no_grad():
        assert kernel("flex", cpu, 0.0) == "flex"
    with pytest.raises(ConfigError, match="no backward on the CPU"):
        kernel("flex", cpu, 0.0)
    with pytest.raises(ConfigError, match="no attention dropout"):
        kernel("flex", cuda, 0.1)


def test_config_checks_the_kernel():
    with pytest.raises(ConfigError, match="model.document_attention='fast' is not one of auto"):
        Config(model=ModelConfig(document_attention="fast")).validate()
    with pytest.raises(ConfigError, match="no attention dropout"):
        Config(model=ModelConfig(document_attention="flex", dropout=0.1)).validate()
    assert Config().data.document_masking is False


# ---- the planner: the mask's bytes ---------------------------------------------------------------

def test_the_planner_counts_one_mask_per_micro_batch():
    """GPT-2 124M, micro batch 8 of 1024 in bf16: the SDPA mask is 8 x 1024 x 1024 x 2 bytes once (not per
    layer), flex's block mask 8 int32 tensors of 8 x 8 blocks (and 8) per row; nothing without masking."""
    import dataclasses

    from zerodp.planner import Cluster, Layout, Workload, estimate, gpu_preset, preset
    from zerodp.planner.memory import document_mask_bytes

    m, h100 = preset("gpt2"), Cluster(gpu=gpu_preset("h100"), gpus_per_node=1, nodes=1)
    plain = Workload(8, 1024, "bf16")
    acts = {kind: estimate(m, Layout("single", h100, dataclasses.replace(
        plain, document_masking=True, document_attention=kind))).activations_bytes for kind in ("sdpa", "flex", "auto")}
    base = estimate(m, Layout("single", h100, plain)).activations_bytes
    assert acts["sdpa"] - base == 8 * 1024 * 1024 * 2 == 16_777_216
    assert acts["flex"] - base == acts["auto"] - base == 4 * 4 * 8 * 8 * 9 == 9_216  # auto on CUDA: flex
    on = dataclasses.replace(plain, document_masking=True)
    assert document_mask_bytes(m, on, cuda=False) == 16_777_216  # auto on the CPU: sdpa
    assert document_mask_bytes(dataclasses.replace(m, dropout=True), on, cuda=True) == 16_777_216  # flex: no dropout
    assert document_mask_bytes(m, dataclasses.replace(on, precision="fp32"), cuda=False) == 2 * 16_777_216


def test_the_planner_figures_are_the_masks_sizes():
    """The formulas against the tensors zerodp.models.docmask builds (flex's BlockMask built on the CPU)."""
    import dataclasses

    from zerodp.planner import Workload, preset
    from zerodp.planner.memory import document_mask_bytes

    doc_ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 300, 250, 350]))[None].expand(2, 1000)
    w = Workload(2, 1000, "bf16", document_masking=True)
    block = document_mask(doc_ids, "flex", torch.bfloat16)
    tensors = [block.kv_num_blocks, block.kv_indices, block.full_kv_num_blocks, block.full_kv_indices,
               block.q_num_blocks, block.q_indices, block.full_q_num_blocks, block.full_q_indices]
    m = preset("gpt2")
    assert sum(t.nbytes for t in tensors) == document_mask_bytes(m, dataclasses.replace(w, document_attention="flex"),
                                                                 cuda=True) == 4 * 4 * 2 * 8 * 9
    mask = document_mask(doc_ids, "sdpa", torch.bfloat16)
    assert mask.shape == (2, 1, 1000, 1000) and mask.nbytes == document_mask_bytes(m, w, cuda=False) == 4_000_000


def test_a_training_config_with_document_masking_is_planned_with_its_mask():
    from zerodp.config import load_config
    from zerodp.planner.training import estimate_for_run

    over = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=256", "train.micro_batch_size=4",
            "train.global_batch_size=8", "strategy.name=ddp"]
    got = {on: estimate_for_run(load_config(None, over + [f"data.document_masking={on}"]), 2, 2**30).activations_bytes
           for on in ("false", "true")}
    assert got["true"] - got["false"] == 4 * 256 * 256 * 4  # CPU ranks, fp32: the sdpa mask
