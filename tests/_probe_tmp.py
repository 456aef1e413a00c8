import torch
from zerodp.config import load_config

BASE = ["model.n_layer=2", "model.n_head=4", "model.n_embd=256", "model.block_size=64", "model.vocab_size=256",
        "train.micro_batch_size=2", "train.global_batch_size=8", "strategy.bucket_size_mb=1",
        "strategy.deepspeed.zero_optimization.stage3_param_persistence_threshold=0", "train.seed=0"]

def probe(runs):
    import torch.distributed as dist
    from zerodp.dist import init_distributed
    from zerodp.model import GPT
    from zerodp.strategies import RunContext, make_strategy
    from zerodp.strategies.common import tensor_bytes
    env = init_distributed("cpu")
    out = {}
    for name, prec in runs:
        ov = BASE + [f"strategy.name={name}", f"train.precision={prec}"]
        if name != "zero3" and name.startswith("zero") is False:
            ov = [o for o in ov if "stage3" not in o]
        cfg = load_config(None, ov)
        torch.manual_seed(0)
        model, s = GPT(cfg.model), make_strategy(name)
        s.setup(model, RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 2))
        x = torch.randint(0, 256, (2, 64))
        for step in range(2):
            for i in range(2):
                with s.micro_step(is_last=i == 1):
                    with s.autocast():
                        loss = s.model(x, x)
                    s.backward(loss)
            if step == 1:
                held = s.state_bytes()
                attrs = {}
                if name.startswith("zero"):
                    from zerodp.strategies.zero import _tensors
                    for a, v in vars(s.model.optimizer).items():
                        b = tensor_bytes(_tensors(v))
                        if b:
                            attrs[a] = b
                    for a, v in vars(s.model).items():
                        b = tensor_bytes(_tensors(v))
                        if b and a != "module":
                            attrs["engine." + a] = b
                    attrs["pgrad"] = tensor_bytes(p.grad for p in s.module.parameters())
                    attrs["pdata"] = tensor_bytes(p.data for p in s.module.parameters())
                    attrs["dstensor"] = tensor_bytes(getattr(p, "ds_tensor", None) for p in s.module.parameters())
            s.step(1e-3)
        held_after = s.state_bytes()
        out[f"{name}-{prec}"] = {"held": held, "attrs": attrs, "after": held_after}
    return out

def probe_ag(name="zero2", prec="bf16"):
    from zerodp.dist import init_distributed
    from zerodp.model import GPT
    from zerodp.strategies import RunContext, make_strategy
    env = init_distributed("cpu")
    cfg = load_config(None, BASE + [f"strategy.name={name}", f"train.precision={prec}"])
    torch.manual_seed(0)
    model, s = GPT(cfg.model), make_strategy(name)
    s.setup(model, RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 2))
    x = torch.randint(0, 256, (2, 64))
    for i in range(2):
        with s.micro_step(is_last=i == 1):
            s.backward(s.model(x, x))
    o = s.model.optimizer
    ag = o.averaged_gradients
    rows = []
    for k, v in ag.items():
        rows.append((k, type(v).__name__, getattr(v, "flat_partition", None) is not None))
        for t in v:
            rows.append((tuple(t.shape), t.numel(), t.untyped_storage().nbytes(), t.untyped_storage().data_ptr() % 100000))
    rows.append(("partition_size", [int(p) for p in o.partition_size]))
    rows.append(("fp32 numel", [t.numel() for t in o.single_partition_of_fp32_groups]))
    return rows

def _fsdp_unsharded(model):
    from zerodp.strategies.common import tensor_bytes
    ts = []
    for unit in [*model.blocks(), model]:
        st = unit._get_fsdp_state()
        pg = st._fsdp_param_group
        if pg is None:
            continue
        for fp in pg.fsdp_params:
            ts.append(getattr(fp, "unsharded_accumulated_grad", None))
            up = getattr(fp, "_unsharded_param", None)
            ts.append(getattr(up, "grad", None) if up is not None else None)
    return tensor_bytes(ts)

def probe2(runs, extra=()):
    from zerodp.dist import init_distributed
    from zerodp.model import GPT
    from zerodp.strategies import RunContext, make_strategy
    env = init_distributed("cpu")
    out = {}
    for name, prec in runs:
        ov = BASE + list(extra) + [f"strategy.name={name}", f"train.precision={prec}"]
        cfg = load_config(None, ov)
        torch.manual_seed(0)
        model, s = GPT(cfg.model), make_strategy(name)
        s.setup(model, RunContext(cfg, env.rank, env.world_size, env.local_rank, env.device, 2))
        x = torch.randint(0, cfg.model.vocab_size, (2, 64))
        pts = []
        for step in range(2):
            for i in range(2):
                with s.micro_step(is_last=i == 1):
                    with s.autocast():
                        loss = s.model(x, x)
                    s.backward(loss)
                if step == 1:
                    h = s.state_bytes()
                    if name == "fsdp":
                        h["unsharded_grads"] = _fsdp_unsharded(s.model)
                    pts.append(h)
            s.step(1e-3)
        out[f"{name}-{prec}"] = pts
    return out
