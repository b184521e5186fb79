"""`pdserve bench transfer` on CPU: two processes, tcp, checksums verified, JSON with the fields the report needs;
the module entry point and the older --out spelling still work."""

import argparse
import json
import subprocess
import sys

import pytest

from pdserve.bench import transfer as bench_transfer
from pdserve.kv.model_shapes import kv_shape


def test_model_shapes():
    assert kv_shape("qwen3-8b").block_bytes(16) == 36 * 2 * 16 * 8 * 128 * 2  # 2.25 MiB, as in the anchor
    with pytest.raises(ValueError, match="unknown model config"):
        kv_shape("no-such-model")


@pytest.mark.timeout(180)
def test_bench_transfer_tcp_cpu(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_transfer.add_arguments(parser)
    out = tmp_path / "r.json"
    args = parser.parse_args(["--transport", "tcp", "--backend", "numpy", "--block-bytes", str(96 << 10),
                              "--num-blocks", "48", "--iters", "3", "--warmup", "1", "--latency-iters", "10",
                              "--tcp-connections", "2", "--result-dir", str(tmp_path), "--result-filename", "r.json"])
    assert bench_transfer.main(args) == 0
    r = json.loads(out.read_text())
    assert r["machine"]["hostname"] and "torch" in r["machine"] and r["args"]["result_filename"] == "r.json"
    assert "git_commit" in r
    assert r["checks"] == {"write_checksums_match": True, "write_differed_before": True,
                           "read_checksums_match": True, "read_differed_before": True}
    for op in ("write", "read"):
        res = r["results"][op]
        assert res["transport"] == "tcp" and res["bytes"] == 48 * (96 << 10)
        assert res["descs_in"] == 48 and 1 <= res["descs_out"] <= 48
        assert res["median_ms"] > 0 and res["p99_ms"] >= res["median_ms"] and res["fraction_of_ceiling"] > 0
    lat = r["results"]["single_block_write"]
    assert lat["descs_in"] == 1 and lat["e2e_median_us"] > 0
    for op in ("write", "read"):
        ceil = r["ceilings"][op]
        assert ceil["GBps"] > 0 and {"streams_1", "streams_2"} <= set(ceil) and op in ceil["what"]
        assert r["results"][op]["ceiling_GBps"] == ceil["GBps"]
    printed = capsys.readouterr().out
    assert "ceiling for read" in printed and f"wrote {out}" in printed


@pytest.mark.timeout(180)
def test_module_entry_point_and_old_out_flag(tmp_path):
    out = tmp_path / "old.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.bench.transfer", "--transport", "tcp", "--backend", "numpy",
                        "--block-bytes", "65536", "--num-blocks", "8", "--iters", "1", "--warmup", "1", "--ops",
                        "write", "--latency-iters", "0", "--tcp-connections", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["checks"]["write_checksums_match"] and rec["results"]["write"]["bytes"] == 8 * 65536
