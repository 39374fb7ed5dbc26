"""bench/ncu_sass_report.py on a small source page written here in ncu's CSV form: two kernels,
a prologue, a loop and an epilogue; every figure checked against the hand count."""
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import ncu_sass_report as nsr  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)",'
          '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
          '"stall_wait","stall_barrier","stall_wait (Not Issued)"')


def row(addr, src, samples, executed, wait, barrier):
    return f'"{addr}","{src}","{samples}","0","{executed}","{wait}","{barrier}","99"'


CSV = "\n".join([
    '"Kernel Name","void a_kernel<(bool)1>(int)",',
    HEADER,
    row("0x10", "      LDC R1, c[0x0][0x28]", 2, 8, 2, 0),
    row("0x20", "      S2R R0, SR_TID.X", 1, 8, 1, 0),
    row("0x30", "@!P0 FFMA.FTZ R2, R3, R4, R5", 10, 64, 6, 4),
    row("0x40", "      MUFU.EX2 R2, R2", 30, 64, 30, 0),
    row("0x50", "      FFMA R6, R2, R2, R6", 5, 64, 5, 0),
    row("0x60", "      BAR.SYNC.DEFER_BLOCKING 0x0", 12, 64, 0, 12),
    row("0x70", "      STG.E desc[UR4][R8.64], R6", 4, 8, 4, 0),
    "",
    '"Kernel Name","other_kernel(float *)",',
    HEADER,
    row("0x10", "      EXIT", 1, 4, 1, 0),
])


def kernels():
    return nsr.parse(io.StringIO(CSV))


def test_parse_two_kernels():
    ks = kernels()
    assert [k[0] for k in ks] == ["void a_kernel<(bool)1>(int)", "other_kernel(float *)"]
    assert len(ks[0][2]) == 7 and len(ks[1][2]) == 1


def test_opcode_drops_predicate_and_modifiers():
    assert nsr.opcode("@!P0 FFMA.FTZ R2, R3, R4, R5") == "FFMA"
    assert nsr.opcode("  MUFU.EX2 R2, R2") == "MUFU"
    assert nsr.opcode("") == "?"


def test_analyse_counts():
    name, header, rows = kernels()[0]
    a = nsr.analyse(header, rows, top=3, min_region=2)
    assert a["samples"] == 64 and a["executed"] == 8 + 8 + 64 * 4 + 8
    assert a["instructions"] == 7
    assert a["stalls"]["wait"] == 48 and a["stalls"]["barrier"] == 16
    assert "wait (Not Issued)" not in a["stalls"]  # issued and not-issued are not mixed
    # the prologue (two instructions x8), the loop (four x64), the store (one x8: kept, 6%)
    assert [(r["first"], r["last"], r["count"], r["samples"]) for r in a["regions"]] == [
        (0, 1, 8, 3), (2, 5, 64, 57), (6, 6, 8, 4)]
    assert [(h["index"], h["reason"]) for h in a["hot"]] == [(3, "wait"), (5, "barrier"),
                                                              (2, "wait")]
    assert a["mix_samples"]["FFMA"] == 15 and a["mix_executed"]["FFMA"] == 128


def test_report_names_the_kernel_and_its_loop():
    name, header, rows = kernels()[0]
    out = io.StringIO()
    nsr.report(name, nsr.analyse(header, rows, top=3, min_region=2), top=3, out=out)
    text = out.getvalue()
    assert "== void a_kernel<(bool)1>(int)" in text
    assert "x64" in text and "89.1% of samples" in text  # the loop: 57 of 64 samples


def test_main_rejects_a_csv_without_the_kernel(tmp_path):
    p = tmp_path / "sass.csv"
    p.write_text(CSV)
    try:
        nsr.main([str(p), "--kernel", "no_such_kernel"])
    except SystemExit as e:
        assert "no kernel matching no_such_kernel" in str(e)
    else:
        raise AssertionError("expected an exit")
