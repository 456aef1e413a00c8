"""Bad LoRA settings are refused before anything runs, each in one line that says what to change: rank 0,
a target that names no layer, an unknown key in model.lora, and a model.lora.init_from PEFT folder that
does not fit (another rank, alpha, targets or model width, a missing file, a pickle); through `zerodp
train` one line on stderr and exit 2, no traceback."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.cli_checks import one_line_error
from zerodp.cli.commands import main
from zerodp.config import ModelConfig
from zerodp.convert.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapters, read_adapters, write_peft
from zerodp.errors import ConfigError
from zerodp.models.arch import arch_of
from zerodp.models.lora_spec import adapter_shapes, check_targets, lora_spec

LLAMA = dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, vocab_size=256,
             block_size=16)
TRAIN = ["train", "configs/llama-tiny.yaml", "strategy.name=single", "model.n_layer=2", "model.n_embd=32",
         "model.intermediate_size=64", "model.block_size=16", "train.global_batch_size=2", "train.micro_batch_size=2",
         "data.max_bytes=100000", "--dry-run"]


def peft_folder(path, n_embd=32, rank=4, alpha=8, targets=("q_proj", "v_proj")):
    """A PEFT folder of random adapters for the tiny llama of width `n_embd`, as zerodp convert writes one."""
    model = ModelConfig(**{**LLAMA, "n_embd": n_embd, "intermediate_size": 2 * n_embd})
    spec = lora_spec({"rank": rank, "alpha": alpha, "targets": list(targets)})
    arch = arch_of(model)
    g = torch.Generator().manual_seed(0)
    adapters = {n: torch.randn(s, generator=g) for n, s in adapter_shapes(arch, spec).items()}
    write_peft(adapters, path, arch, spec, None, {"zerodp.source": "{}"})
    return adapters


def test_model_lora_settings_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank=0 must be a positive whole number such as 16 \(the "
                                          r"adapters' rank\); for full fine-tuning remove model\.lora$"):
        lora_spec({"rank": 0})
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank is not set: set it to a positive whole number such as "
                                          r"16 \(the adapters' rank\), or model\.lora\.init_from to a PEFT folder to "
                                          r"take it from; for full fine-tuning remove model\.lora$"):
        lora_spec({"alpha": 8})
    with pytest.raises(ConfigError, match=r"^model\.lora\.rank is not set and model\.lora\.init_from /nowhere holds no "
                                          r"readable adapter_config\.json to take it from; give a PEFT adapter folder "
                                          r"there, or set model\.lora\.rank$"):
        lora_spec({"init_from": "/nowhere"})
    with pytest.raises(ConfigError, match=r"^unknown key 'ranq' in model\.lora; did you mean 'rank'\?$"):
        lora_spec({"rank": 4, "ranq": 8})
    with pytest.raises(ConfigError, match=r"^model\.lora\.targets: 'qq_proj' names no linear layer of llama's blocks; "
                                          r"did you mean 'q_proj'\? its linear layers are down_proj, gate_proj, "
                                          r"k_proj, o_proj, q_proj, up_proj, v_proj \(or all-linear\)$"):
        check_targets(arch_of(ModelConfig(**LLAMA)), lora_spec({"rank": 4, "targets": ["qq_proj"]}))


def test_a_peft_folder_that_does_not_fit_is_refused(tmp_path):
    arch = arch_of(ModelConfig(**LLAMA))
    spec = lora_spec({"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "init_from": str(tmp_path / "a")})
    written = peft_folder(tmp_path / "a")
    got = read_adapters(tmp_path / "a", arch, spec)  # the folder as written reads back, tensor for tensor
    assert got.keys() == written.keys() and all(torch.equal(got[n], written[n]) for n in got)
    where = str(tmp_path / "a")
    with pytest.raises(ConfigError, match=rf"^model\.lora\.init_from {where} has rank r=4 but model\.lora\.rank is 8; "
                                          r"set model\.lora\.rank=4 to start from it$"):
        check_adapters(where, arch, lora_spec({"rank": 8, "alpha": 8, "targets": ["q_proj", "v_proj"]}))
    with pytest.raises(ConfigError, match=r"has lora_alpha=8 but model\.lora\.alpha is 16; set model\.lora\.alpha=8"):
        check_adapters(where, arch, lora_spec({"rank": 4, "targets": ["q_proj", "v_proj"], "alpha": 16}))
    with pytest.raises(ConfigError, match=r"adapts q_proj, v_proj \(target_modules \['q_proj', 'v_proj'\]\) but "
                                          r"model\.lora\.targets adapts q_proj; set model\.lora\.targets"):
        check_adapters(where, arch, lora_spec({"rank": 4, "alpha": 8, "targets": ["q_proj"]}))
    peft_folder(tmp_path / "wide", n_embd=64)  # an adapter made for a base twice as wide
    with pytest.raises(ConfigError, match=r"base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight is "
                                          r"\[4, 64\] there but \[4, 32\] in this model \(n_embd 32\); the adapter was "
                                          r"made for a base of another shape"):
        check_adapters(tmp_path / "wide", arch, spec)
    (tmp_path / "a" / ADAPTER_WEIGHTS).rename(tmp_path / "a" / "adapter_model.bin")
    with pytest.raises(ConfigError, match=r"holds a pickled adapter \(adapter_model\.bin\), and zerodp never loads a "
                                          r"pickle \(it can run code\); save it as safetensors"):
        check_adapters(where, arch, spec)
    (tmp_path / "a" / "adapter_model.bin").unlink()
    with pytest.raises(ConfigError, match=r"holds no adapter_model\.safetensors; give a complete PEFT adapter folder"):
        check_adapters(where, arch, spec)
    config = json.loads((tmp_path / "wide" / ADAPTER_CONFIG).read_text())
    (tmp_path / "wide" / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ConfigError, match=r"sets use_dora=True, which zerodp's LoRA does not compute"):
        check_adapters(tmp_path / "wide", arch_of(ModelConfig(**{**LLAMA, "n_embd": 64, "intermediate_size": 128})),
                       spec)


@pytest.mark.parametrize("settings,pattern", [
    (["model.lora.rank=0"], r"^zerodp: error: model\.lora\.rank=0 must be a positive whole number"),
    (["model.lora.rank=4", "model.lora.targets=[qq_proj]"], r"^zerodp: error: model\.lora\.targets: 'qq_proj' names "
                                                             r"no linear layer of llama's blocks"),
    (["model.lora.rank=4", "model.lora.ranq=8"], r"^zerodp: error: unknown key 'ranq' in model\.lora; did you mean "
                                                  r"'rank'\?$"),
    (["model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=[q_proj, v_proj]", "model.lora.init_from={wide}"],
     r"^zerodp: error: model\.lora\.init_from .*wide: base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A"
     r"\.weight is \[4, 64\] there but \[4, 32\] in this model"),
])
def test_zerodp_train_says_a_bad_lora_setting_in_one_line(tmp_path, capsys, settings, pattern):
    peft_folder(tmp_path / "wide", n_embd=64)
    args = [*TRAIN, f"train.out_dir={tmp_path / 'run'}", *(s.format(wide=tmp_path / "wide") for s in settings)]
    one_line_error(capsys, main(args), pattern)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_model_init_from_at_adapters_names_the_adapter_settings(tmp_path, capsys):
    """model.init_from at a PEFT folder: adapters, not a model; the line names model.lora.init_from and
    the merge (a LoRA run's checkpoint: tests/distributed/test_lora_export.py)."""
    peft_folder(tmp_path / "a")
    where = tmp_path / "a"
    code = main([*TRAIN, f"train.out_dir={tmp_path / 'run'}", f"model.init_from={where}", "model.lora.rank=4"])
    one_line_error(capsys, code, rf"^zerodp: error: model\.init_from {where} is a PEFT adapter folder \(adapters, not "
                                 rf"a model\); to go on from its adapters set model\.lora\.init_from={where} and "
                                 rf"model\.init_from to their base \(the model they were trained on\), or merge them "
                                 rf"into a model with `zerodp convert {where} OUT --to hf --merge` and set "
                                 rf"model\.init_from=OUT$")
    assert not (tmp_path / "run").exists()


def test_a_rope_base_starts_a_run_at_another_block_size(tmp_path, capsys):
    """A llama's weights do not depend on block_size (RoPE): model.init_from of one saved at 16 starts a
    run at 32, as a Hugging Face folder's does; gpt2's learned positions are a weight of that length."""
    from safetensors.torch import save_file

    from zerodp.models import build_model

    model = ModelConfig(**LLAMA)
    base = build_model(model, seed=0)
    section = {k: v for k, v in LLAMA.items()}
    save_file({n: p.detach().contiguous() for n, p in base.named_parameters()}, tmp_path / "base.safetensors",
              metadata={"zerodp.config": json.dumps({"model": section}), "zerodp.layout": "zerodp"})
    for lora in ([], ["model.lora.rank=4"]):
        args = [*TRAIN, f"train.out_dir={tmp_path / 'run'}", f"model.init_from={tmp_path / 'base.safetensors'}",
                "model.block_size=32", *lora]
        assert main(args) == 0, capsys.readouterr().err
