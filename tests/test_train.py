"""launch/train.py: the synthetic recall data, token files, and a 2-rank DeepSpeed run on the CPU
that saves, resumes and prints its JSON summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))

from train_data import FIRST_TOKEN, SyntheticRecall, TokenFile, sample_index  # noqa: E402


def test_synthetic_recall_plants_keys_early_and_asks_for_them_last():
    data = SyntheticRecall(seq_len=200, vocab=512, seed=1, keys=3, key_vocab=10)
    s = data.sample(5)
    ids, mask = s.input_ids[0], s.answer_mask[0]
    assert ids.shape == mask.shape == (200,) and ids.dtype == torch.int64
    assert torch.equal(ids, data.sample(5).input_ids[0])  # a pure function of (seed, index)
    assert not torch.equal(ids, data.sample(6).input_ids[0])
    first_key = FIRST_TOKEN + 3
    for j in range(3):
        marker, key = ids[194 + 2 * j], ids[195 + 2 * j]
        assert marker == FIRST_TOKEN + j and first_key + 10 * j <= key < first_key + 10 * (j + 1)
        planted = (ids[:194] == key).nonzero().flatten().tolist()
        assert len(planted) == 1 and planted[0] < 100  # once, in the first half
    assert (ids[:194] >= first_key + 30).sum() == 194 - 3  # everything else is filler
    assert mask.nonzero().flatten().tolist() == [194, 196, 198]  # positions whose next token is a key
    assert sample_index(step=2, micro=1, accumulation=4, dp_rank=1, dp_size=2) == 19
    with pytest.raises(ValueError, match="vocabulary above"):
        SyntheticRecall(seq_len=200, vocab=37, seed=0, keys=3, key_vocab=10)


def test_token_files(tmp_path):
    tokens = np.arange(1000) % 97
    np.save(tmp_path / "t.npy", tokens.astype(np.int32))
    tokens.astype(np.uint16).tofile(tmp_path / "t.bin")
    a = TokenFile(str(tmp_path / "t.npy"), 64, vocab=97, seed=0).sample(3).input_ids
    b = TokenFile(str(tmp_path / "t.bin"), 64, vocab=97, seed=0, dtype="uint16").sample(3).input_ids
    assert torch.equal(a, b) and a.shape == (1, 64)
    assert torch.equal(a[0, 1:] - a[0, :-1], torch.where(a[0, 1:] == 0, -96, 1))  # a window of the file
    with pytest.raises(ValueError, match=r"must lie in \[0, 50\)"):
        TokenFile(str(tmp_path / "t.npy"), 64, vocab=50, seed=0).sample(0)
    with pytest.raises(ValueError, match=r"\.npy or \.bin"):
        TokenFile(str(tmp_path / "t.txt"), 64, vocab=97, seed=0)


def _train(tmp_path, *args: str) -> tuple[dict, dict, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = tmp_path / f"run{len(list(tmp_path.glob('run*.json')))}.json"
    # tests/interpreted_script.py: the ranks' kernels under the suite's interpreter settings
    # (steps 4.7 -> 2.3 s).
    cmd += ["tests/interpreted_script.py", "launch/train.py", "--model", "tiny", "--seq-len", "32"]
    cmd += ["--json", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # the last line is the JSON summary
    return summary, json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_train_refuses_a_negative_time_limit(value, capsys):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    import train

    with pytest.raises(SystemExit):
        train.parse_args(["--time-limit", value])
    assert "--time-limit must be a number of seconds >= 0" in capsys.readouterr().err
    assert train.parse_args(["--time-limit", "0"]).time_limit == 0.0


def test_activation_checkpointing_can_keep_attention():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    import train

    import ringflash

    assert train.parse_args([]).activation_checkpointing is None
    assert train.parse_args(["--activation-checkpointing", "--steps", "2"]).activation_checkpointing == "full"
    keep = ["--activation-checkpointing", "keep-attention"]
    assert train.kept_attention(train.parse_args(keep)) is ringflash.attention_checkpoint_context
    sdpa = train.kept_attention(train.parse_args([*keep, "--sp-impl", "deepspeed-ulysses"]))
    assert torch.ops.aten._scaled_dot_product_cudnn_attention.default in sdpa.args[0]
    with pytest.raises(ValueError, match="exact attention"):
        train.kept_attention(train.parse_args([*keep, "--attention", "infini"]))


def test_train_saves_resumes_and_summarizes(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    ck = tmp_path / "ck"
    common = ["--dtype", "fp32", "--optimizer", "sgd", "--lr", "1", "--grad-clip", "0", "--save-dir", str(ck)]
    # --profile runs one more step, kept out of the checkpoints, the history and the throughput.
    summary, full, stdout = _train(tmp_path, "--steps", "2", "--save-every", "1", "--profile", *common)
    assert "profile: step" in stdout
    assert summary["summary"] == "train" and summary["sp_size"] == 2 and summary["steps_run"] == 2
    assert [r["step"] for r in full["history"]] == [1, 2] and not (ck / "step3").exists()
    for key in ("tokens_per_s_per_gpu", "mfu", "peak_mem_gib", "final_recall_acc", "params"):
        assert key in summary
    (ck / "latest").write_text("step1")  # resume from step 1, not from the final save
    # +N counts from the resumed step; the time limit stops after the step that passes it, and
    # that step's checkpoint and history are kept as at the last step.
    timed, part, stdout = _train(tmp_path, "--steps", "+5", "--time-limit", "0", "--resume", str(ck), *common)
    assert "--time-limit 0 s reached after step 2" in stdout, stdout[-2000:]
    assert timed["steps_run"] == 1 and [r["step"] for r in part["history"]] == [1, 2]
    assert part["history"][:1] == full["history"][:1]  # carried in the checkpoint
    got, want = part["history"][1]["loss"], full["history"][1]["loss"]
    assert abs(got - want) < 1e-5 * want, (got, want)  # the restored weights took the same step
    assert (ck / "latest").read_text().strip() == "step2"
