"""LoRA under FSDP2 over 2-way tensor-parallel groups (dp_shard 2 x tp 2, 4 gloo workers,
one launch) on a pretrained Hugging Face Llama: the adapters laid out like their base
(colwise: lora_B split by rows, lora_A whole; rowwise: lora_A split by columns, lora_B
whole, the partial sums reduced with the base's) train the losses of one process; step 0's
logits are the base model's (transformers'); no frozen shard changes; only rank 0 reads
the base to identify it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import hang_limit, run_limited, tiny_llama, worker_failure

pytest.importorskip("transformers")
# The fixture's launch of 4 workers and one process's run in this one.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(hang_limit(launches=2, procs=4, steps=8))]

WORKER = Path(__file__).with_name("lora_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list[dict]]:
    """(the model directory, one process's result in-process, the 4 workers' results)."""
    sys.path.insert(0, str(WORKER.parent))
    import lora_worker

    root = tmp_path_factory.mktemp("lora_dist")
    folder = tiny_llama(root / "llama", vocab=98)
    out = root / "out"
    out.mkdir()
    limit = hang_limit(procs=4, steps=lora_worker.STEPS)
    proc = run_limited(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         "--standalone", str(WORKER), str(folder), str(out), "2", f"{limit:g}"],
        what="lora_worker.py on 4 workers (dp_shard 2 x tp 2)", limit=limit,
    )
    assert proc.returncode == 0, worker_failure(proc.stderr)
    single = lora_worker.run(folder, 1, 1)
    return folder, single, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_dp_shard_by_tp_gives_one_process_losses_and_adapters(results):
    """Measured: losses within 1.5e-6 relative, adapters within 5.3e-6 (of values up to
    0.18; the sums run in another order across heads and ranks)."""
    import torch

    _, single, ranks = results
    assert single["losses"][-1] != single["losses"][0]
    for r in ranks:
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert r["adapters"].keys() == single["adapters"].keys()  # adapters only, same names
        for name, values in r["adapters"].items():
            torch.testing.assert_close(
                torch.tensor(values), torch.tensor(single["adapters"][name]),
                rtol=0, atol=5e-5, msg=name,
            )


def test_step_zero_is_the_base_model(results):
    import torch

    folder, single, ranks = results
    want = torch.load(folder / "logits.pt")
    for r in [single, *ranks]:
        got = torch.tensor(r["logits"])
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_the_frozen_base_does_not_change(results):
    _, single, ranks = results
    for r in [single, *ranks]:
        assert r["before"] == r["after"]
    assert len({r["before"] for r in ranks}) == 4  # each rank checks its own shards


def test_without_trainwise_launcher_only_rank_0_reads_the_base(results):
    """torchrun started the workers by hand: rank 0 reads the weights once for the job and
    broadcasts their id (worker.first_rank_base_weights)."""
    from trainwise.models.hf_weights import weight_files, weights_digest

    folder, _, ranks = results
    assert [r["base_weights"] for r in ranks] == [weights_digest(folder)] * 4
    assert [r["base_reads"] for r in ranks] == [len(weight_files(folder)), 0, 0, 0]
