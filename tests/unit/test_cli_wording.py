"""Lines of the command line that read as sentences: what a flag without its companion means, and its help."""

from __future__ import annotations

import pytest

from zerodp.cli.commands import main


@pytest.mark.parametrize("flags,said", [
    (["--lora-alpha", "8"], "--lora-alpha applies to adapters, and without --lora-rank there are none; "
                            "add --lora-rank R (e.g. --lora-rank 16)"),
    (["--lora-targets", "q_proj", "--lora-alpha", "8"],
     "--lora-targets and --lora-alpha apply to adapters, and without --lora-rank there are none; "),
])
def test_a_lora_flag_without_a_rank_says_so_in_a_sentence(flags, said, capsys):
    assert main(["plan", "--model", "llama3-8b", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"zerodp: error: {said}" in err, err


def test_plan_help_says_what_lora_alpha_is(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("--lora-alpha A with --lora-rank: the adapters' alpha, their output scaled by alpha / rank (default 2 x "
            "rank); the memory does not depend on it") in text
