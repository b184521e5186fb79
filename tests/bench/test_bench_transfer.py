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


def _mooncake_installed() -> bool:
    from pdserve.kv.errors import TransportUnavailableError
    from pdserve.kv.transports.mooncake import load_engine

    try:
        load_engine()
    except TransportUnavailableError:
        return False
    return True


@pytest.mark.timeout(240)
def test_bench_transfer_all_transports_one_table(tmp_path, capsys):
    """Every transport both processes offer, same bytes, same run, the raw-socket ceiling interleaved with all."""
    parser = argparse.ArgumentParser()
    bench_transfer.add_arguments(parser)
    args = parser.parse_args(["--transport", "all", "--backend", "numpy", "--block-bytes", str(64 << 10),
                              "--num-blocks", "24", "--iters", "2", "--warmup", "1", "--latency-iters", "5",
                              "--tcp-connections", "1", "--kv-protocol", "tcp", "--result-dir", str(tmp_path),
                              "--result-filename", "all.json"])
    assert bench_transfer.main(args) == 0
    r = json.loads((tmp_path / "all.json").read_text())
    want = ["tcp", "nccl"] + (["mooncake"] if _mooncake_installed() else [])
    for t in want:
        for op in ("write", "read"):
            res = r["results"][f"{op}:{t}"]
            assert res["transport"] == t and res["bytes"] == 24 * (64 << 10)
            assert res["ceiling_GBps"] == r["ceilings"][op]["GBps"] and res["fraction_of_ceiling"] > 0
            assert r["checks"][f"{op}:{t}_checksums_match"] and r["checks"][f"{op}:{t}_differed_before"]
        assert r["results"][f"single_block_write:{t}"]["e2e_median_us"] > 0
    printed = capsys.readouterr().out
    assert all(f"write:{t}" in printed for t in want)


@pytest.mark.timeout(240)
def test_bench_transfer_memcheck_nccl_cpu(tmp_path):
    """32 handovers' worth of transfers in flight over nccl (Gloo here): memory does not grow by even one."""
    parser = argparse.ArgumentParser()
    bench_transfer.add_arguments(parser)
    args = parser.parse_args(["--transport", "nccl", "--backend", "numpy", "--block-bytes", str(256 << 10),
                              "--num-blocks", "48", "--warmup", "1", "--memcheck", "32", "--result-dir",
                              str(tmp_path), "--result-filename", "mem.json"])
    assert bench_transfer.main(args) == 0
    r = json.loads((tmp_path / "mem.json").read_text())
    m = r["memcheck"]
    assert m["transfers_in_flight"] == 32 and m["transport"] == "nccl" and m["bytes_moved"] == 32 * 48 * (256 << 10)
    assert r["checks"] == {"memcheck_checksums_match": True, "memcheck_no_growth": True}
    for side in m["sides"].values():
        assert side["kind"] == "resident set size" and side["grew_bytes"] < m["bytes_per_transfer"]
