"""The vLLM worker's pure helpers (workers/llm_engine.py), without vLLM: what moves, what is
refused before it can reach the engine, where the KV lives and what gets swept."""

from __future__ import annotations

import os
import time

from batchyard import protocol as P
from batchyard.workers.llm_engine import check_job, kv_root, moved_tokens, sampling_kwargs, sweep_stale


def test_only_whole_blocks_move_and_never_the_last_token():
    assert [moved_tokens(n, 32) for n in (1, 32, 33, 40, 64, 65, 100, 300)] == [0, 0, 32, 32, 32, 64, 96, 288]


def test_requests_the_engine_cannot_run_are_refused_with_a_reason():
    job = P.LlmJob(job_id=1, kind="generate", seqs=[1, 2, 3, 4], prompts=[[1, 2], [], [5] * 60, [1, 9999]],
                   max_tokens=[4, 4, 8, 4])
    ok, empty, too_long, bad_id = check_job(job, max_model_len=64, vocab=4096)
    assert ok == "" and "empty" in empty and "max_model_len 64" in too_long and "[0, 4096)" in bad_id
    mismatched = P.LlmJob(job_id=2, kind="prefill", seqs=[1, 2], prompts=[[1]], max_tokens=[1, 1])
    assert all("must match" in why for why in check_job(mismatched, 64, 4096))


def test_both_instances_of_a_node_compute_the_same_kv_folder_and_greedy_params():
    a, b = kv_root("ipc:///run/n0/be", "tiny"), kv_root("ipc:///run/n0/be", "tiny")
    assert a == b and a != kv_root("ipc:///run/n1/be", "tiny") and kv_root("x", "tiny", "/srv/kv") == a.__class__("/srv/kv")
    kw = sampling_kwargs(8, kv="load")
    assert kw["temperature"] == 0.0 and kw["max_tokens"] == 8 and kw["extra_args"]["kv_transfer_params"]["batchyard"] == "load"
    assert "extra_args" not in sampling_kwargs(8)


def test_stale_kv_entries_are_swept_fresh_ones_kept(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "layer0.safetensors").write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old, (past, past))
    assert sweep_stale(tmp_path, older_than_s=600) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new"]
