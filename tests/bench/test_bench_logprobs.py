"""scripts/bench_logprobs.py: the head benchmark runs every (chunk, vocabulary block) case
it is asked for, both passes, and prints one JSON report naming the machine."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_logprobs import main, vocab_blocks  # noqa: E402


def test_vocab_blocks_parses_auto_rows_and_columns():
    assert vocab_blocks("auto,0,1024", 4096) == {"auto": None, "rows": 4096, "vb1024": 1024}
    with pytest.raises(SystemExit, match="vocab-chunk-sizes"):
        vocab_blocks("auto,wide", 4096)


def test_main_reports_every_case_and_pass(capsys):
    main(
        "--batch 2 --seq 16 --d-model 8 --vocab 300 --chunk-sizes 8 "
        "--vocab-chunk-sizes auto,0,128 --repeats 1".split()
    )
    report = json.loads(capsys.readouterr().out)
    assert report["cpu"] and report["shapes"]["N"] == 32
    cases = {(r["case"], r["pass"]) for r in report["results"]}
    names = ("plain", "chunked_c8_auto", "chunked_c8_rows", "chunked_c8_vb128")
    assert cases == {(n, p) for n in names for p in ("forward", "grad")}
    assert all(r["median_s"] > 0 and r["temp_bytes"] >= 0 for r in report["results"])
