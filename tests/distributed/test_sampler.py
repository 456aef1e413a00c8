"""The sampler in a real run: training on a mixture of two prepared folders at world 2, with document
masking (doc_ids from the folders' indexes), follows one process on the same global batches, and resumed
at world 1 continues the same epoch order (the trajectory of one uninterrupted process);
metrics.jsonl records epochs and each source's validation loss, the same one process computes (`zerodp
eval`: the validation set does not depend on the world size); `zerodp eval` and `plan --from-run` read
the run; and `zerodp data batch --decode` prints exactly the tokens each rank's loop handed the model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.harness import run_distributed
from tests.support.reference import reference_run
from tests.support.text_fixtures import stdlib_texts, train_bpe, write_jsonl
from zerodp.cli.commands import main
from zerodp.config import load_config
from zerodp.data.prepare import PrepareOptions, prepare

STEPS, G, MICRO = 4, 8, 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    tok = train_bpe(root / "tok" / "tokenizer.json", vocab_size=400, n_files=20)
    texts = stdlib_texts(24)
    out = []
    for name, part in (("code", texts[:12]), ("more", texts[12:])):
        docs = write_jsonl(root / f"{name}.jsonl", part)
        prepare(PrepareOptions(inputs=[str(docs)], tokenizer=str(tok), out=str(root / name), val_fraction=0.2,
                               progress=False))
        out.append(root / name)
    return root, tok, out


def test_a_mixture_at_world_2_follows_one_process_and_data_batch_decodes_it(tiny, folders, capsys):
    from tokenizers import Tokenizer

    root, tok, (a, b) = folders
    run = root / "run"
    over = [*[o for o in tiny if not o.startswith("model.vocab_size=")], f"train.global_batch_size={G}",
            f"train.micro_batch_size={MICRO}", f"train.max_steps={STEPS}", "train.eval_every=2", "train.eval_batches=1",
            f"data.sources=[{{path: {a}, weight: 0.75}}, {{path: {b}, weight: 0.25}}]", f"train.out_dir={run}",
            f"checkpoint.every={STEPS}", "train.grad_noise_scale=true", "data.document_masking=true",
            "optim.decay_steps=10"]  # the schedule of a run continued past max_steps (the resume below)
    ranks = run_distributed("tests.support.sampler_workers:record_batches", 2, {"overrides": over})
    assert ranks[0]["arity"] == ranks[1]["arity"] == [3]  # every micro batch carried doc_ids to the model
    expected, _ = reference_run(load_config(None, over))  # one process, each step's whole global batch
    losses = [ranks[0]["losses"][s] for s in sorted(ranks[0]["losses"])]
    assert np.allclose(losses, expected, atol=1e-5), (losses, expected)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["epoch"] == max(r["epoch/code"], r["epoch/more"]) > 0 for r in records)
    last = records[-1]
    assert last["val_loss"] == pytest.approx(0.75 * last["val_loss/code"] + 0.25 * last["val_loss/more"])

    def cli(*args):  # the command line's own entry point, in this process
        capsys.readouterr()
        code = main(list(map(str, args)))
        out, err = capsys.readouterr()
        assert code == 0, err
        return out

    # The validation set is the same at every world size: one process (zerodp eval, the same code) on the
    # step-4 checkpoint computes the val_loss the two ranks logged, each source's too (it took twice the
    # samples at world 2 before)
    validation = json.loads(cli("eval", run, "--json", "--no-progress"))
    assert abs(validation["val_loss"] - last["val_loss"]) < 1e-6, (validation, last)
    assert all(abs(validation["sources"][n]["val_loss"] - last[f"val_loss/{n}"]) < 1e-6 for n in ("code", "more"))
    # zerodp eval and plan --from-run read the mixture's run as any other
    result = json.loads(cli("eval", run, "--json", "--max-tokens", 2000, "--no-progress"))
    each = result["sources"]
    assert set(each) == {"code", "more"} and each["code"]["source"] == str(a / "val.bin")
    assert result["val_loss"] == pytest.approx(0.75 * each["code"]["val_loss"] + 0.25 * each["more"]["val_loss"])
    assert "critical batch measured by" in cli("plan", "--from-run", run)

    tokenizer = Tokenizer.from_file(str(tok))
    for step in (0, STEPS - 1):
        rows = json.loads(cli("data", "batch", run, "--step", step, "--world", 2, "--micro", MICRO, "--json",
                              "--decode"))["rows"]
        assert [row["source"] for row in rows].count("code") == 6  # 0.75 of 8
        for row in rows:
            got = ranks[row["rank"]]["rows"][step][row["micro"]][row["row"] % MICRO]  # what that rank's loop received
            assert row["text"] == tokenizer.decode(got, skip_special_tokens=False)
            assert row["tokens"][1] - row["tokens"][0] == len(got)

    own = json.loads(cli("data", "batch", run, "--step", 0, "--json"))  # no --world: the run's, from its checkpoint
    assert (own["world"], own["micro"], own["accumulation"]) == (2, MICRO, G // (2 * MICRO))
    assert [r["rank"] for r in own["rows"]] == [j // (G // 2) for j in range(G)]

    # Resumed from step STEPS's checkpoint at another world size (1: 4 accumulation steps of 2), the run
    # trains the samples the epoch order puts next: the uninterrupted trajectory, step for step.
    more = [o for o in over if not o.startswith(("train.max_steps=", "checkpoint.every="))]
    more += [f"train.max_steps={STEPS + 2}", "checkpoint.every=0"]
    resumed = run_distributed("tests.support.sampler_workers:record_batches", 1, {"overrides": more, "fresh": False})
    got = resumed[0]["losses"]
    assert sorted(got) == [STEPS + 1, STEPS + 2], sorted(got)
    whole, _ = reference_run(load_config(None, more))
    assert np.allclose([got[s] for s in sorted(got)], whole[STEPS:], atol=1e-5), (got, whole)
    assert np.allclose(whole[:STEPS], expected, atol=1e-6)  # the same run's first steps, as checked above
