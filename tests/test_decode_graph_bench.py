"""benchmarks.decode_graph off a GPU: its correctness mode (the segments graph's layer body on the
benchmark's synthetic batch against the formula), and the table's ratios. Its timings need CUDA and
FlashInfer (docs/gpu.md)."""

from __future__ import annotations

from benchmarks import decode_graph
from benchmarks.decode_graph import Row, table
from sgl_kvevict.engine.decode_graph import DecodeGraphState


def test_the_check_passes_and_fails_when_the_compressed_part_is_left_out(monkeypatch, capsys):
    assert decode_graph.main(["--check"]) == 0
    assert capsys.readouterr().out.count("ok  ") == 4
    # The dense part alone: the 25% rows now miss the kept cells.
    monkeypatch.setattr(DecodeGraphState, "attend_with_dense", lambda self, q, layer, k, v, cells_per_sequence, out, lse: out)
    assert decode_graph.main(["--check"]) == 1
    assert capsys.readouterr().out.count("FAIL") == 2


def test_the_table_reads_the_ratios_the_targets_name():
    row = Row("Llama-3-8B", 8, 8192, dense_eager=2.0, dense_graphed=1.0, kept_eager=1.5, kept_graphed=0.4,
              dense_metadata=0.2, kept_metadata=0.5, difference=1e-2, graph_vs_eager=0.0)  # fmt: skip
    line = table([row], "a GPU").splitlines()[-1]
    assert line == "| Llama-3-8B | 8 | 8192 | 2.000 | 1.000 | 1.500 | 0.400 | 0.40x | 2.50x | 0.200 / 0.500 | 1.0e-02 | 0.0e+00 |"
