"""What the plan's table and sentences say: durations from nanoseconds to minutes (a tiny model's step
is microseconds)."""

import argparse
import json
import re

import pytest

from zerodp.planner.cli import add_parser, run
from zerodp.planner.units import seconds

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def plan_output(capsys, *argv) -> str:
    parser = argparse.ArgumentParser(prog="zerodp")
    add_parser(parser.add_subparsers(dest="command"))
    assert run(parser.parse_args(["plan", *argv])) == 0
    return capsys.readouterr().out


# --- durations ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("s, text", [
    (0, "0 s"), (3e-10, "0.30 ns"), (4.2e-9, "4.20 ns"), (1.25e-6, "1.25 µs"), (4.17e-5, "41.7 µs"),
    (9.996e-4, "1.00 ms"), (0.0294, "29.4 ms"), (0.477, "477 ms"), (0.9996, "1.00 s"), (2.45, "2.45 s"),
    (12.34, "12.3 s"), (1250, "1,250 s"),
])
def test_durations_pick_their_unit(s, text):
    assert seconds(s) == text


def test_a_tiny_models_plan_tells_its_step_times_apart(tmp_path, capsys):
    """Item 11: `zerodp plan --hf-config` of a tiny model printed 'predicted 0 ms per step vs 0 ms for
    zero3, 2.1x as long'."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    out = plan_output(capsys, "--hf-config", str(tmp_path), "--gpus", "8")
    assert not re.search(r"\b0 ms\b", out), out
    slower = re.findall(r"predicted (\S+ \S+) per step vs (\S+ \S+) for \S+, (?:\d+% slower|[\d.]+x as long)", out)
    assert slower, out
    for mine, chosen in slower:
        assert mine != chosen, (mine, chosen)
    assert re.search(r"^ddp: fits .*, but slower: predicted \d\.\d\d µs per step vs \d\.\d\d µs for zero3, 2\.1x "
                     r"as long: \d\.\d\d µs of communication is not hidden", out, re.M), out
